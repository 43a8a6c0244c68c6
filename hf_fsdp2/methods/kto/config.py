"""The KTO recipe's keys (TRL's KTOConfig names) and the reference keys it shares with DPO
(:class:`~hf_fsdp2.config.preference.ReferenceArgs`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_fsdp2.config.plans import check
from hf_fsdp2.config.preference import ReferenceArgs

KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")


@dataclass(kw_only=True)
class KtoArgs(ReferenceArgs):
    """Kahneman-Tversky optimisation on unpaired ``prompt`` / ``completion`` / ``label`` examples (recipes/kto.py)."""

    beta: float = field(
        default=0.1,
        metadata={"help": "How far the policy may move from the reference (TRL's KTOConfig default 0.1)."},
    )
    loss_type: str = field(
        default="kto",
        metadata={
            "help": f"One of {', '.join(KTO_LOSS_TYPES)} (TRL's KTOConfig): kto estimates a KL reference point from "
            "each micro-batch; apo_zero_unpaired has no KL term."
        },
    )
    desirable_weight: float = field(
        default=1.0, metadata={"help": "Weight of a desirable (label true) example's loss (TRL's name)."}
    )
    undesirable_weight: float = field(
        default=1.0, metadata={"help": "Weight of an undesirable (label false) example's loss (TRL's name)."}
    )

    def validate(self) -> None:
        """Raises ConfigError for a value argparse cannot refuse."""
        check(
            self.loss_type in KTO_LOSS_TYPES,
            f"loss_type={self.loss_type!r} is not a loss of the KTO recipe: one of {', '.join(KTO_LOSS_TYPES)} "
            "(sigmoid, ipo, robust, hinge, simpo, orpo: paired objectives of recipes/dpo.py)",
        )
        check(self.beta > 0, f"beta={self.beta} must be > 0 for KTO")
        for key in ("desirable_weight", "undesirable_weight"):
            check(getattr(self, key) > 0, f"{key}={getattr(self, key)} must be > 0")
        self.validate_reference()
