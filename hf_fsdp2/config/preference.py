"""The reference-model keys that the preference methods share (DPO, KTO; TRL's names): a method's config section
inherits them (:mod:`hf_fsdp2.methods.dpo.config`, :mod:`hf_fsdp2.methods.kto.config`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_fsdp2.config.plans import check


@dataclass(kw_only=True)
class ReferenceArgs:
    """The reference model of a preference objective: a frozen sharded copy, a precomputed table, or with LoRA the
    base with the adapter disabled."""

    precompute_ref_log_probs: bool = field(
        default=False,
        metadata={
            "help": "Compute the reference log-probs of every example in one pass before training (no reference "
            "model in memory while training)."
        },
    )
    precompute_ref_batch_size: int | None = field(
        default=None,
        metadata={"help": "Examples per rank per batch of that pass; default per_device_train_batch_size."},
    )
    ref_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Reference model folder or hub id; default the model being trained (its weights as loaded). "
            "Ignored with LoRA, whose reference is the base with the adapter disabled."
        },
    )
    disable_dropout: bool = field(
        default=True,
        metadata={
            "help": "Set every dropout of the policy and reference to 0 (TRL's default), so log-probs are exact."
        },
    )

    def validate_reference(self) -> None:
        """Raises ConfigError for a reference value argparse cannot refuse."""
        check(
            self.precompute_ref_batch_size is None or self.precompute_ref_batch_size >= 1,
            f"precompute_ref_batch_size={self.precompute_ref_batch_size} must be >= 1",
        )
