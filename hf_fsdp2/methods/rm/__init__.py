"""Reward modelling: ``config`` (its keys), ``step`` (the Bradley-Terry step and its evaluation), ``objective`` (the
score-head model, the step and the evaluator of a run); the data is the DPO recipe's pairs, each row the whole
prompt + completion."""

from __future__ import annotations

from typing import Any

from hf_fsdp2.config import Config
from hf_fsdp2.data.preference_sets import preview_pairs
from hf_fsdp2.methods.rm.config import RmArgs
from hf_fsdp2.methods.rm.objective import build_rm_data, rm_objective
from hf_fsdp2.run.method import Method


def _notes(cfg: Config, plan: Any, model_config: Any) -> list[str]:
    return [
        "reward model planned as the causal LM it is loaded from, 2 rows per pair: its LM head and logits are "
        "counted, where the run has a score head of hidden_size x 1 and no vocabulary logits (an overestimate)"
    ]


METHOD = Method(
    name="rm",
    title="reward modelling",
    build_data=build_rm_data,
    objective=rm_objective,
    section=RmArgs,
    defaults={"long_examples": "drop"},  # a cut row loses the end its reward is read at (TRL drops too)
    batch_rows="padded",
    rows_per_example=lambda cfg: 2,  # the chosen and the rejected row of each pair, one forward
    plan_notes=_notes,
    preview_data=preview_pairs,
    tags=("reward-model",),
)
