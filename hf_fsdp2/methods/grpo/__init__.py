"""GRPO, online RL with verifiable rewards: ``config`` (its keys), ``data`` (prompts and the columns the reward
functions read), ``batching`` (TRL's generation batches and steps), ``rollout`` (sampling completions from the sharded
policy), ``rewards`` (built-in and user reward functions), ``loss`` (TRL's formulas, the chunked scoring), ``step``
(the buffered generation batch, rewards, the clipped surrogate loss, one update per step), ``metrics`` (what a step
logs), ``objective`` (the generator, the reference, the step and the evaluator of a run)."""

from __future__ import annotations

from typing import Any

from hf_fsdp2.config import Config
from hf_fsdp2.methods.grpo.config import GrpoArgs
from hf_fsdp2.methods.grpo.data import build_grpo_data, preview_prompts
from hf_fsdp2.methods.grpo.objective import grpo_objective
from hf_fsdp2.methods.grpo.plan import colocate_note, rollout_note
from hf_fsdp2.run.method import Method


def _notes(cfg: Config, plan: Any, model_config: Any) -> list[str]:
    import torch

    gpu = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    colocate = colocate_note(plan, cfg, gpu)
    return [rollout_note(plan, model_config, cfg), *([colocate] if colocate else [])]


METHOD = Method(
    name="grpo",
    title="GRPO (online RL with verifiable rewards)",
    build_data=build_grpo_data,
    objective=grpo_objective,
    section=GrpoArgs,
    # The rollout decodes one token at a time with a growing KV cache: compiled layers would see a new shape at every
    # token (recompiles, or dynamo's fallback to eager at its limit). torch_compile: true compiles anyway.
    defaults={"torch_compile": False},
    batch_rows="padded",
    # per_device_train_batch_size counts completions (TRL's meaning): a micro-batch row is one completion.
    plan_notes=_notes,
    preview_data=preview_prompts,
)
