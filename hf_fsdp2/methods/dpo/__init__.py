"""DPO and its variants (IPO, robust, hinge, cDPO), SimPO and ORPO: ``config`` (its keys), ``data`` (preference pairs
and their micro-batches), ``loss`` (the objectives' formulas), ``step`` (the preference step and its evaluation),
``objective`` (the reference, the step and the evaluator of a run)."""

from __future__ import annotations

from typing import Any

from hf_fsdp2.config import Config
from hf_fsdp2.methods.dpo.config import DpoArgs
from hf_fsdp2.methods.dpo.data import build_dpo_data, preview_pairs
from hf_fsdp2.methods.dpo.objective import dpo_objective
from hf_fsdp2.trainer.method import Method


def reference_note(cfg: Config, name: str, free: str = "") -> list[str]:
    """The plan's line for a frozen reference copy it does not count (none with precompute, LoRA or ``free``)."""
    p = cfg.method
    if p.precompute_ref_log_probs or cfg.peft.use_peft or getattr(p, "reference_free", False):
        return []
    return [
        f"not planned: {name}'s reference model (a frozen sharded copy of the policy, its gathered layers during "
        f"its forward); precompute_ref_log_probs: true, use_peft: true{free} trains without one"
    ]


def _notes(cfg: Config, plan: Any, model_config: Any) -> list[str]:
    return reference_note(cfg, "DPO", " or loss_type simpo / orpo")


METHOD = Method(
    name="dpo",
    title="preference optimisation",
    build_data=build_dpo_data,
    objective=dpo_objective,
    section=DpoArgs,
    batch_rows="padded",
    rows_per_example=lambda cfg: 2,  # the chosen and the rejected row of each pair, one forward
    plan_notes=_notes,
    preview_data=preview_pairs,
    context_parallel=True,  # each rank scores its part of every row; the row sums are all-reduced over the group
)
