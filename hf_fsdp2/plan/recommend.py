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
    if candidate.cp != configured.cp:
        # The cp ranks of a group read one batch: fewer data-parallel ranks, so more accumulation keeps the global
        # batch; the ranks a parameter is sharded over (dp_shard x cp) stay the same.
        out["cp_size"] = candidate.cp
        out["gradient_accumulation_steps"] = candidate.gradient_accumulation_steps
        if candidate.shard_size != candidate.world_size:  # HSDP: dp_shard_size is set, and shrinks by cp
            out["dp_shard_size"] = candidate.shard_size // candidate.cp
    if candidate.cpu_offload != configured.cpu_offload:
        out["fsdp_cpu_offload"] = candidate.cpu_offload
    if candidate.ep != configured.ep:
        out["ep_size"] = candidate.ep
    return out


def proposed_ep(model_config: Any, settings: PlanSettings) -> int | None:
    """The ``ep_size`` :mod:`hf_fsdp2.plan.experts` proposes for this run (None: a dense model, experts that do not
    dominate, a run that has one already, or none that moves fewer bytes)."""
    from hf_fsdp2.plan.experts import expert_plan
    from hf_fsdp2.plan.meta_model import build_meta_model

    if settings.ep != 1 or settings.shard_size == 1:
        return None
    experts = expert_plan(build_meta_model(model_config, settings), model_config, settings)
    return None if experts is None else experts.proposed


def context_parallel_sizes(model_config: Any, settings: PlanSettings) -> list[int]:
    """The ``cp_size`` values above the configured one that the run would take: powers of two that divide the
    ranks a parameter is sharded over and the query heads (:func:`~hf_fsdp2.config.plans.split_heads`, KV heads
    repeated as the run repeats them), at most the sequence length."""
    from hf_fsdp2.config.plans import ConfigError, split_heads

    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = getattr(text, "num_attention_heads", None)
    sizes = []
    cp = settings.cp * 2
    while heads and settings.shard_size % cp == 0 and cp <= settings.seq_len:
        try:
            split_heads(int(heads), getattr(text, "num_key_value_heads", None), cp)
        except ConfigError:
            break
        sizes.append(cp)
        cp *= 2
    return sizes


def _context_rungs(settings: PlanSettings, sizes: list[int]) -> Iterator[PlanSettings]:
    """Each sequence over more ranks (the all-to-all backend): 1/cp of its activations per rank, an all-to-all
    of q/k/v and the output per layer; gradient accumulation x the factor keeps the global batch."""
    for cp in sizes:
        factor = cp // settings.cp
        yield settings.replace(
            cp=cp, gradient_accumulation_steps=settings.gradient_accumulation_steps * factor
        )


def _ladder_base(settings: PlanSettings) -> Iterator[PlanSettings]:
    """Settings from the cheapest in step time to the dearest, whatever the recipe chose: no activation
    checkpointing and no offload at the recipe's micro-batch; chunked cross entropy (no recompute); more
    activation checkpointing (every_k, selective, full: less kept each); smaller micro-batches under full
    checkpointing (gradient accumulation keeps the global batch; smaller matmuls). The offload rungs follow
    (:func:`_offload_rungs`)."""
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


def _offload_rungs(current: PlanSettings) -> Iterator[PlanSettings]:
    """On a GPU, activations offloaded to host memory, then parameters, gradients and optimizer state too."""
    if current.device_type != "cuda":
        return
    current = current.replace(ac=ACPlan("offload", current.ac.every_k, pin_memory=True))
    yield current
    yield current.replace(cpu_offload=True)


def recommend(
    model_config: Any,
    settings: PlanSettings,
    budget: int,
    headroom: float = DEFAULT_HEADROOM,
    *,
    context_parallel: bool = False,
    expert_parallel: bool = False,
) -> list[Candidate]:
    """Plans from the cheapest settings on (:func:`_ladder_base`, then :func:`_offload_rungs`), until one fits ``budget`` bytes per device.

    A plan fits when its peak is at most ``(1 - headroom) x budget``: the CUDA context, NCCL's buffers and
    the caching allocator's fragmentation live outside the counted tensors. With ``context_parallel`` (the
    method splits sequences: sft, cpt) and a sequence whose activations, loss and working set do not fit beside
    the sharded state at micro-batch 1 under full checkpointing, larger ``cp_size`` values the heads allow
    (:func:`context_parallel_sizes`) come before the GPU offload rungs, which then keep the largest cp tried.

    Returns:
        The candidates tried, in order, each with the recipe keys that differ from ``settings``; the last one
        fits unless none does.

    Raises:
        PlanError: a model or setting that cannot be planned.
    """
    limit = budget * (1 - headroom)
    tried: list[Candidate] = []

    def fits(candidate: PlanSettings) -> bool:
        plan = plan_memory(model_config, candidate)
        tried.append(Candidate(_changes(settings, candidate), plan, plan.peak <= limit))
        return tried[-1].fits

    ep = proposed_ep(model_config, settings) if expert_parallel else None
    start = settings if ep is None else settings.replace(ep=ep)
    current = start
    for current in _ladder_base(start):
        if fits(current):
            return tried
    if context_parallel and _sequence_does_not_fit(tried[-1].plan, limit):
        for wider in list(_context_rungs(current, context_parallel_sizes(model_config, current))):
            current = wider
            if fits(current):
                return tried
    for candidate in _offload_rungs(current):
        if fits(candidate):
            break
    return tried


def _sequence_does_not_fit(plan: MemoryPlan, limit: float) -> bool:
    """Whether one micro-batch's activations, loss and working set exceed what the sharded state and the FSDP
    buffers leave of ``limit`` on the worst rank."""
    items = plan.rank_total(plan.worst_rank)
    compute = items["activations"] + items["loss_logits"] + items["transient"]
    return compute > limit - (items["peak"] - compute)


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
            + ". More GPUs (--world_size), a shorter max_length, LoRA (--use_peft true) or, for sft and cpt, a "
            "larger cp_size (each sequence over more ranks) lower it"
        )
    return "\n".join(lines)
