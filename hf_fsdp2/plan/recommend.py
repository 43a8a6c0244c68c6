"""The cheapest settings that fit a GPU: plans along a ladder from the fastest settings to the most frugal
(:func:`recommend`) and the lines ``hf-fsdp2 plan --gpu_memory`` prints (:func:`format_recommendation`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hf_fsdp2.config.plans import ACPlan
from hf_fsdp2.plan.settings import DEFAULT_HEADROOM, PlanSettings
from hf_fsdp2.plan.table import ROWS, MemoryPlan, human_bytes, plan_memory

# Activation-checkpointing modes from the least to the most recompute (docs/performance.md measures them).
_AC_LADDER = ("none", "every_k", "selective", "full")


@dataclass(frozen=True)
class Candidate:
    """One rung of the recommendation ladder: the recipe keys it changes, its plan, whether it fits."""

    changes: dict[str, Any]
    plan: MemoryPlan
    fits: bool


def _changes(configured: PlanSettings, candidate: PlanSettings) -> dict[str, Any]:
    """The recipe keys (and values) that turn ``configured`` into ``candidate``."""
    out: dict[str, Any] = {}
    if candidate.ac.mode != configured.ac.mode:
        out["activation_checkpointing"] = candidate.ac.mode
    if candidate.ce_chunk_tokens != configured.ce_chunk_tokens:
        out["ce_chunk_tokens"] = candidate.ce_chunk_tokens
    if candidate.micro_batch != configured.micro_batch:
        out["per_device_train_batch_size"] = candidate.micro_batch
        out["gradient_accumulation_steps"] = candidate.gradient_accumulation_steps
    if candidate.cpu_offload != configured.cpu_offload:
        out["fsdp_cpu_offload"] = candidate.cpu_offload
    return out


def _ladder(settings: PlanSettings) -> Iterator[PlanSettings]:
    """Settings from the cheapest in step time to the dearest, whatever the recipe chose: no activation
    checkpointing and no offload at the recipe's micro-batch; chunked cross entropy (no recompute); more
    activation checkpointing (every_k, selective, full: less kept each); smaller micro-batches under full
    checkpointing (gradient accumulation keeps the global batch; smaller matmuls); on a GPU, activations
    offloaded to host memory, then parameters, gradients and optimizer state offloaded too."""
    ac = settings.ac
    current = settings.replace(ac=ACPlan("none", ac.every_k, pin_memory=ac.pin_memory), cpu_offload=False)
    yield current
    if current.ce_chunk_tokens == 0:
        current = current.replace(ce_chunk_tokens=1024)
        yield current
    for mode in _AC_LADDER[1:]:
        current = current.replace(ac=ACPlan(mode, ac.every_k, pin_memory=ac.pin_memory))
        yield current
    while current.micro_batch > 1:
        batch = current.micro_batch // 2
        accumulation = current.gradient_accumulation_steps * current.micro_batch // batch
        current = current.replace(micro_batch=batch, gradient_accumulation_steps=accumulation)
        yield current
    if current.device_type != "cuda":
        return
    current = current.replace(ac=ACPlan("offload", ac.every_k, pin_memory=True))
    yield current
    yield current.replace(cpu_offload=True)


def recommend(
    model_config: Any, settings: PlanSettings, budget: int, headroom: float = DEFAULT_HEADROOM
) -> list[Candidate]:
    """Plans from the cheapest settings on (:func:`_ladder`), until one fits ``budget`` bytes per device.

    A plan fits when its peak is at most ``(1 - headroom) x budget``: the CUDA context, NCCL's buffers and
    the caching allocator's fragmentation live outside the counted tensors.

    Returns:
        The candidates tried, in order, each with the recipe keys that differ from ``settings``; the last one
        fits unless none does.

    Raises:
        PlanError: a model or setting that cannot be planned.
    """
    limit = budget * (1 - headroom)
    tried: list[Candidate] = []
    for candidate in _ladder(settings):
        plan = plan_memory(model_config, candidate)
        tried.append(Candidate(_changes(settings, candidate), plan, plan.peak <= limit))
        if tried[-1].fits:
            break
    return tried


def format_recommendation(tried: list[Candidate], budget: int, headroom: float) -> str:
    """The ladder tried, one line each, and the recommendation (or why nothing fits)."""
    limit = budget * (1 - headroom)
    lines = [
        f"cheapest settings that fit {human_bytes(budget)} per device with {headroom:.0%} headroom "
        f"(peak <= {human_bytes(limit)}):"
    ]
    for c in tried:
        keys = ", ".join(f"{k}={v}" for k, v in c.changes.items()) or "as configured"
        lines.append(f"  {'fits' if c.fits else 'no':<4}  peak {human_bytes(c.plan.peak):>11}  {keys}")
    if tried and tried[-1].fits:
        keys = " ".join(
            f"--{k} {str(v).lower() if isinstance(v, bool) else v}" for k, v in tried[-1].changes.items()
        )
        lines.append(f"recommended: {keys or 'the recipe as it is'}")
    elif tried:
        last = tried[-1].plan
        items = last.rank_total(last.worst_rank)
        labels = dict(ROWS)
        biggest = sorted((k for k in labels if items[k]), key=lambda k: -items[k])[:2]
        state = items["params"] + items["grads"] + items["optimizer"]
        lines.append(
            f"does not fit: even the last settings tried peak at {human_bytes(last.peak)} > {human_bytes(limit)}; "
            + ", ".join(f"{labels[k]} {human_bytes(items[k])}" for k in biggest)
            + (
                f" (sharded state alone {human_bytes(state)})"
                if state
                else " (the sharded state is in host memory)"
            )
            + ". More GPUs (--world_size), a shorter max_length or LoRA (--use_peft true) lower it"
        )
    return "\n".join(lines)
