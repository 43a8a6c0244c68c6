"""GRPO's rollout phase in the memory plan: while completions are generated every FSDP unit is gathered (one full
copy of the model per rank, in the compute dtype; ``rollout_gather: layer``: FSDP2's own units in flight) and the KV
cache of the sequences of one generate call (``rollout_batch_size``; default the rank's whole share of the
generation batch) grows to ``max_length`` tokens, beside the sharded parameters and optimizer state (gradients are
freed by then). The training phase is the plan's table: micro-batches of ``per_device_train_batch_size``
completions, scored through the chunked head when ``ce_chunk_tokens`` > 0 (the plan's chunked loss: the same
``[chunk x vocab]`` blocks); the run's peak is the larger of the two."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hf_fsdp2.config import ConfigError
from hf_fsdp2.methods.grpo.batching import layout_of

_BYTES = {"bf16": 2, "fp16": 2, "fp8": 2, "bfloat16": 2, "float16": 2, "float32": 4, "no": 4, "auto": 2}


@dataclass(frozen=True, kw_only=True)
class RolloutBytes:
    gathered: int  # the whole model, gathered
    kv_cache: int
    logits: int  # one position's logits per sequence, fp32
    state: int  # this rank's sharded parameters and optimizer state
    sequences: int  # per generate call
    chunks: int = 1  # generate calls per generation batch

    @property
    def peak(self) -> int:
        return self.gathered + self.kv_cache + self.logits + self.state


def rollout_bytes(plan: Any, model_config: Any, cfg: Any) -> RolloutBytes:
    """The rollout phase of a GRPO run with ``cfg`` on the worst rank of ``plan``."""
    t, g, d = cfg.train, cfg.method, cfg.data
    compute = t.mixed_precision if t.mixed_precision != "no" else cfg.model.torch_dtype
    size = _BYTES.get(compute, 4)
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    layers = int(getattr(text, "num_hidden_layers", 0))
    heads = int(getattr(text, "num_attention_heads", 1))
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    layout = layout_of(cfg, plan.settings.world_size)  # GRPO refuses cp and tp: every rank is data-parallel
    sequences = layout.rollout_batch_size
    kv = 2 * layers * kv_heads * head_dim * sequences * d.max_length * size
    state = plan.per_rank[plan.worst_rank]
    layered = getattr(g, "rollout_gather", "full") == "layer"  # FSDP2's own units in flight, as in training
    return RolloutBytes(
        gathered=plan.fsdp_buffers if layered else plan.total_params * size,
        kv_cache=kv,
        logits=sequences * int(getattr(text, "vocab_size", 0)) * 4,
        state=int(state["params"] + state["optimizer"]),
        sequences=sequences,
        chunks=layout.rollout_chunks,
    )


def rollout_note(plan: Any, model_config: Any, cfg: Any) -> str:
    """One line for the plan: the rollout phase's bytes per rank against the training peak."""
    from hf_fsdp2.plan.table import human_bytes

    try:
        r = rollout_bytes(plan, model_config, cfg)
    except ConfigError as err:  # a generation batch these ranks cannot hold: the run refuses it the same way
        return f"GRPO rollout phase not planned: {err}"
    which = "the run's peak" if r.peak > plan.peak else "under the training peak"
    return (
        f"GRPO rollout phase {human_bytes(r.peak)} per rank ({which}): "
        f"{'FSDP buffers (rollout_gather: layer)' if cfg.method.rollout_gather == 'layer' else 'the model gathered'} "
        f"{human_bytes(r.gathered)} + "
        f"KV cache {human_bytes(r.kv_cache)} ({r.sequences} sequences x max_length {cfg.data.max_length}, one of "
        f"{r.chunks} generate call(s) per generation batch: rollout_batch_size) + last "
        f"logits {human_bytes(r.logits)} + sharded parameters and optimizer state {human_bytes(r.state)}"
    )


def colocate_gpu_bytes(peak: int, utilization: float, headroom: float) -> int:
    """The smallest GPU on which a colocated engine (``utilization`` of the GPU, vLLM's reservation) and training
    (``peak`` per rank, with the recommender's ``headroom`` kept free) fit side by side without sleep mode."""
    return int(peak / max((1.0 - utilization) * (1.0 - headroom), 1e-9))


def choose_sleep_mode(
    asked: bool | None, *, peak: int | None, gpu_bytes: int | None, utilization: float, headroom: float
) -> tuple[bool, str]:
    """Whether a colocated engine sleeps (level 2) between rollouts, and why: as ``asked`` where the key is set;
    unset, only where the engine's reservation (``utilization`` of a GPU of ``gpu_bytes``) and the training ``peak``
    per rank (the start-up plan's; None: no plan) do not fit side by side (:func:`colocate_gpu_bytes`): sleeping
    discards the engine's weights, so every rollout reloads them, updated or not. Without a GPU (None), no sleep:
    vLLM's CPU backend has none. Without a plan, sleep: the choice that fits whatever the peak."""
    from hf_fsdp2.plan.table import human_bytes

    if gpu_bytes is None:
        return False, "off (no GPU: vLLM's CPU backend has no sleep mode)"
    if asked is not None:
        return (
            asked,
            f"{'level 2' if asked else 'off'} (vllm_enable_sleep_mode: {str(asked).lower()}, as set)",
        )
    if peak is None:
        return (
            True,
            "level 2 (vllm_enable_sleep_mode unset and no memory plan to say the engine fits beside training)",
        )
    need = colocate_gpu_bytes(peak, utilization, headroom)
    if gpu_bytes >= need:
        return False, (
            f"off (vllm_enable_sleep_mode unset: the engine and training fit this GPU of {human_bytes(gpu_bytes)}, "
            f"{human_bytes(need)} needed; no reloads)"
        )
    return True, (
        f"level 2 (vllm_enable_sleep_mode unset: the engine and training need {human_bytes(need)} side by side, this "
        f"GPU has {human_bytes(gpu_bytes)})"
    )


def colocate_note(plan: Any, cfg: Any, gpu_bytes: int | None) -> str | None:
    """The plan's line for ``vllm_mode: colocate``: whether the engine fits beside training without sleep mode on a
    GPU of ``gpu_bytes`` (None: no GPU here; the line gives the size it needs), and what the run does (with the key
    unset, what it chooses: :func:`choose_sleep_mode`). None for other runs."""
    from hf_fsdp2.plan.settings import DEFAULT_HEADROOM
    from hf_fsdp2.plan.table import human_bytes

    g, t = cfg.method, cfg.train
    if not (g.use_vllm and g.vllm_mode == "colocate"):
        return None
    size = _BYTES.get(t.mixed_precision if t.mixed_precision != "no" else cfg.model.torch_dtype, 4)
    weights = plan.total_params * size // max(int(g.vllm_tensor_parallel_size), 1)
    need = colocate_gpu_bytes(plan.peak, g.vllm_gpu_memory_utilization, DEFAULT_HEADROOM)
    line = (
        f"GRPO colocate: each engine reserves vllm_gpu_memory_utilization {g.vllm_gpu_memory_utilization:g} of the "
        f"GPU (its weights {human_bytes(weights)} + KV cache) beside the training peak {human_bytes(plan.peak)} per "
        f"rank: without sleep mode they fit on a GPU of {human_bytes(need)} or more"
    )
    if gpu_bytes is None:
        return line + " (no GPU here to compare with)"
    fits = gpu_bytes >= need
    if g.vllm_enable_sleep_mode is None:
        _, why = choose_sleep_mode(
            None,
            peak=plan.peak,
            gpu_bytes=gpu_bytes,
            utilization=g.vllm_gpu_memory_utilization,
            headroom=DEFAULT_HEADROOM,
        )
        verdict = f"; sleep mode {why}"
    elif g.vllm_enable_sleep_mode:
        verdict = (
            "; sleep mode on (level 2: the engine's memory freed while training, its weights reloaded at every "
            "rollout, nothing copied to host memory)"
            + (
                "; this GPU would not need it (vllm_enable_sleep_mode: false skips the reloads)"
                if fits
                else ""
            )
        )
    else:
        verdict = (
            "; this GPU: fits, no sleep mode needed"
            if fits
            else "; this GPU does not fit both: set vllm_enable_sleep_mode: true (level 2), or lower "
            "vllm_gpu_memory_utilization"
        )
    return f"{line} (this GPU: {human_bytes(gpu_bytes)}){verdict}"
