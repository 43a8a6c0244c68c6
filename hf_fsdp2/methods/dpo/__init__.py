"""DPO and its variants (IPO, robust, hinge, cDPO), SimPO and ORPO: ``config`` (its keys), the preference pairs and
their micro-batches (:func:`~hf_fsdp2.run.data.build_pair_data`, shared with reward models), ``loss`` (the objectives' formulas), ``step`` (the preference step and its evaluation),
``objective`` (the reference, the step and the evaluator of a run)."""

from __future__ import annotations

from typing import Any

from hf_fsdp2.config import Config
from hf_fsdp2.data.preference_sets import preview_pairs
from hf_fsdp2.methods.dpo.config import DpoArgs
from hf_fsdp2.methods.dpo.objective import dpo_objective
from hf_fsdp2.run.data import TrainData, build_pair_data
from hf_fsdp2.run.method import Capabilities, Method
from hf_fsdp2.run.reference import reference_note
from hf_fsdp2.run.session import Session


def _notes(cfg: Config, plan: Any, model_config: Any) -> list[str]:
    return reference_note(cfg, "DPO", " or loss_type simpo / orpo")


def build_dpo_data(session: Session, tokenizer: Any) -> TrainData:
    """The run's preference pairs and their micro-batches (:func:`~hf_fsdp2.run.data.build_pair_data`)."""
    return build_pair_data(session, tokenizer, "DPO")


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
    # Each rank scores its part of every row; the row sums are all-reduced over the group (test_context_parallel).
    capabilities=Capabilities(context_parallel=True),
)
