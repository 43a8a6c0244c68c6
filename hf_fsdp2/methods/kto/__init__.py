"""KTO on unpaired data: ``config`` (its keys), ``data`` (unpaired examples with their KL completions), ``step`` (the
KTO step and its evaluation), ``objective`` (the reference, the step and the evaluator of a run)."""

from __future__ import annotations

from typing import Any

from hf_fsdp2.config import Config
from hf_fsdp2.data.preference_sets import preview_unpaired
from hf_fsdp2.methods.kto.config import KtoArgs
from hf_fsdp2.methods.kto.data import build_kto_data
from hf_fsdp2.methods.kto.objective import kto_objective
from hf_fsdp2.run.method import Method
from hf_fsdp2.run.reference import reference_note


def _notes(cfg: Config, plan: Any, model_config: Any) -> list[str]:
    return [
        *reference_note(cfg, "KTO"),
        "KTO rows: the planned forward is the micro-batch's examples (1 row each, with gradient); the KL rows (1 "
        "per example) and the reference run before it without gradient, freeing their activations",
    ]


METHOD = Method(
    name="kto",
    title="KTO on unpaired preference data",
    build_data=build_kto_data,
    objective=kto_objective,
    section=KtoArgs,
    batch_rows="padded",
    plan_notes=_notes,
    preview_data=preview_unpaired,
)
