"""The DPO recipe's keys (TRL's names): DPO and its variants, SimPO and ORPO (``loss_type``), and the reference keys
it shares with KTO (:class:`~hf_fsdp2.config.preference.ReferenceArgs`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_fsdp2.config.plans import check
from hf_fsdp2.config.preference import ReferenceArgs

DPO_LOSS_TYPES = ("sigmoid", "ipo", "robust", "hinge", "simpo", "orpo")
REFERENCE_FREE_LOSS_TYPES = ("simpo", "orpo")  # no reference model, no reference pass


@dataclass(kw_only=True)
class DpoArgs(ReferenceArgs):
    """Direct preference optimisation on ``prompt`` / ``chosen`` / ``rejected`` pairs (recipes/dpo.py)."""

    beta: float = field(
        default=0.1,
        metadata={
            "help": "How far the policy may move from the reference (TRL's DPOConfig default 0.1; IPO: tau, target "
            "1/(2 beta); SimPO: the reward scale; ORPO: lambda)."
        },
    )
    loss_type: str = field(
        default="sigmoid",
        metadata={
            "help": f"Preference loss: one of {', '.join(DPO_LOSS_TYPES)} (TRL's names; simpo is TRL's CPOTrainer "
            "loss_type, orpo its ORPOTrainer); simpo and orpo are reference-free."
        },
    )
    label_smoothing: float = field(
        default=0.0,
        metadata={
            "help": "Probability that a pair's labels are flipped: conservative DPO (cDPO) with sigmoid, "
            "robust DPO with robust; in [0, 0.5)."
        },
    )
    simpo_gamma: float = field(
        default=0.5,
        metadata={"help": "SimPO's target reward margin gamma (TRL's CPOConfig.simpo_gamma)."},
    )
    cpo_alpha: float = field(
        default=0.0,
        metadata={
            "help": "With loss_type simpo: weight of the chosen completions' NLL (0: SimPO as published; TRL's "
            "CPOConfig defaults to 1.0, CPO-SimPO)."
        },
    )

    @property
    def reference_free(self) -> bool:
        """SimPO and ORPO: the policy alone, no reference model or pass."""
        return self.loss_type in REFERENCE_FREE_LOSS_TYPES

    def validate(self) -> None:
        """Raises ConfigError for a value argparse cannot refuse."""
        check(
            self.loss_type in DPO_LOSS_TYPES,
            f"loss_type={self.loss_type!r} is not a loss of the DPO recipe: one of {', '.join(DPO_LOSS_TYPES)} "
            "(kto and apo_zero_unpaired: recipes/kto.py; grpo, dr_grpo, dapo: recipes/grpo.py)",
        )
        check(self.beta > 0, f"beta={self.beta} must be > 0 for DPO, SimPO and ORPO")
        check(0 <= self.label_smoothing < 0.5, f"label_smoothing={self.label_smoothing} must be in [0, 0.5)")
        check(
            self.label_smoothing == 0 or self.loss_type in ("sigmoid", "robust", "simpo"),
            f"label_smoothing={self.label_smoothing} applies to loss_type sigmoid (cDPO), robust or simpo, not "
            f"{self.loss_type!r}; set it to 0",
        )
        check(self.cpo_alpha >= 0, f"cpo_alpha={self.cpo_alpha} must be >= 0")
        check(
            self.cpo_alpha == 0 or self.loss_type == "simpo",
            f"cpo_alpha={self.cpo_alpha} applies to loss_type simpo (CPO-SimPO), not {self.loss_type!r}; set it to 0",
        )
        reference = [k for k in ("precompute_ref_log_probs", "ref_model_name_or_path") if getattr(self, k)]
        check(
            not self.reference_free or not reference,
            f"loss_type={self.loss_type!r} is reference-free (no reference model, no reference pass): "
            f"{', '.join(reference)} would do nothing; unset it, or use a DPO loss_type",
        )
        self.validate_reference()
