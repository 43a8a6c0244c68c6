"""The plan of a run (:func:`plan_memory`: the state, the FSDP buffers and the meta forward's bytes per rank,
as a :class:`MemoryPlan`) and its table (:func:`format_plan`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hf_fsdp2.plan.compute import ComputeBytes, compute_bytes
from hf_fsdp2.plan.context import ContextPlan, context_plan
from hf_fsdp2.plan.experts import ExpertPlan, expert_plan
from hf_fsdp2.plan.meta_model import build_meta_model, check_plannable
from hf_fsdp2.plan.settings import GIB, MIB, PlanSettings
from hf_fsdp2.plan.state import (
    Float8Traffic,
    Unit,
    float8_traffic,
    fsdp_buffer_bytes,
    fsdp_units,
    state_bytes,
)

if TYPE_CHECKING:
    from hf_fsdp2.attention_layout import AttentionLayout


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """Bytes per rank of a run (device memory unless a name says host)."""

    settings: PlanSettings
    model_name: str
    total_params: int
    trainable_params: int
    per_rank: list[dict[str, int]]  # params, grads, optimizer, grads_unsharded of each rank
    fsdp_buffers: int
    fsdp_note: str
    compute: ComputeBytes
    units: list[Unit]
    layout: AttentionLayout | None = None
    context: ContextPlan | None = None  # cp_size > 1: the all-to-all's per-layer shapes
    float8: Float8Traffic | None = None  # mixed_precision=fp8: float8 weights and all-gather bytes
    experts: ExpertPlan | None = None  # a mixture of experts: its traffic and memory at each ep_size

    def rank_total(self, rank: int) -> dict[str, int]:
        """Every item of one rank, its peak included."""
        state = self.per_rank[rank]
        on_device = 0 if self.settings.cpu_offload else 1
        items = {
            "params": state["params"] * on_device,
            "grads": (state["grads"] + state["grads_unsharded"]) * on_device,
            "optimizer": state["optimizer"] * on_device,
            "fsdp_buffers": self.fsdp_buffers,
            "activations": self.compute.saved.activations,
            "loss_logits": self.compute.saved.loss,
            # Expert parallel: the rows one token exchange sends and receives (balanced routing).
            "transient": self.compute.transient
            + (self.experts.current.exchange_buffers if self.experts else 0),
        }
        items["peak"] = sum(items.values())
        items["host_state"] = (state["params"] + state["grads"] + state["optimizer"]) * (1 - on_device)
        items["host_activations"] = self.compute.saved.offloaded
        return items

    @property
    def worst_rank(self) -> int:
        return max(range(len(self.per_rank)), key=lambda r: self.rank_total(r)["peak"])

    @property
    def peak(self) -> int:
        return self.rank_total(self.worst_rank)["peak"]

    def to_json(self) -> dict[str, Any]:
        s = self.settings
        return {
            "model": self.model_name,
            "total_params": self.total_params,
            "trainable_params": self.trainable_params,
            "settings": {
                "world_size": s.world_size,
                "dp_shard_size": s.shard_size // s.cp,
                "cp_size": s.cp,
                "per_device_train_batch_size": s.micro_batch,
                "max_length": s.seq_len,
                "activation_checkpointing": s.ac.mode,
                "ac_every_k": s.ac.every_k,
                "mixed_precision": s.mixed_precision,
                "ce_chunk_tokens": s.ce_chunk_tokens,
                "fsdp_cpu_offload": s.cpu_offload,
                "gradient_accumulation_steps": s.gradient_accumulation_steps,
                "ep_size": s.ep,
                "device": s.device_type,
                "use_peft": s.lora is not None,
                "use_dora": s.lora is not None and s.lora.use_dora,
                "load_in_4bit": s.load_in_4bit,
                "packing": s.packing,
                "padding_free": None if self.layout is None else self.layout.padding_free,
                "attention": None if self.layout is None else self.layout.kernel,
                "dense_mask": None if self.layout is None else self.layout.dense_mask,
            },
            "context_parallel": None
            if self.context is None
            else {
                "cp_size": self.context.split.cp,
                "tokens_per_rank": self.context.part,
                "query_heads_per_rank": self.context.split.heads // self.context.split.cp,
                "kv_heads_per_rank": self.context.split.kv_heads
                * self.context.split.kv_repeat
                // self.context.split.cp,
                "kv_repeat": self.context.split.kv_repeat,
                "gathered_qkv_bytes_per_layer": self.context.gathered_bytes,
                "scattered_output_bytes_per_layer": self.context.scattered_bytes,
                "mask_bytes_per_layer": self.context.mask_bytes,
            },
            "worst_rank": self.worst_rank,
            "peak": self.peak,
            "ranks": [self.rank_total(r) for r in range(len(self.per_rank))],
            "units": [dataclasses.asdict(u) for u in self.units],
            "float8": dataclasses.asdict(self.float8) if self.float8 is not None else None,
            "experts": None
            if self.experts is None
            else {
                **dataclasses.asdict(self.experts.shapes),
                "share": self.experts.shapes.share,
                "ep_size": self.experts.ep,
                "proposed_ep_size": self.experts.proposed,
                "tokens_per_rank": self.experts.tokens,
                "options": [dataclasses.asdict(o) for o in self.experts.options],
            },
        }


def plan_memory(model_config: Any, settings: PlanSettings) -> MemoryPlan:
    """The per-rank memory of a run of ``model_config`` with ``settings`` (no weights read).

    Raises:
        PlanError: a model or setting that cannot be planned, with the reason.
    """
    layout = settings.layout(model_config)
    model = build_meta_model(model_config, settings)
    check_plannable(model_config, model)
    context = None
    if settings.cp > 1:  # before the meta forward: the run's refusals (heads, kernel) first
        itemsize = (settings.compute_dtype or next(p.dtype for p in model.parameters())).itemsize
        context = context_plan(model_config, settings, layout, itemsize)
    per_rank = [state_bytes(model, settings, rank) for rank in range(settings.world_size)]
    units = fsdp_units(model, settings)
    buffers, note = fsdp_buffer_bytes(units, settings)
    return MemoryPlan(
        settings=settings,
        model_name=type(model).__name__,
        total_params=sum(p.numel() for p in model.parameters()),
        trainable_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
        per_rank=per_rank,
        fsdp_buffers=buffers,
        fsdp_note=note,
        compute=compute_bytes(model_config, settings),
        units=units,
        layout=layout,
        context=context,
        float8=float8_traffic(model, settings),
        experts=expert_plan(model, model_config, settings),
    )


def human_bytes(n: float) -> str:
    """``1.50 GiB``, ``12.3 MiB``, ``512 B``."""
    if abs(n) >= GIB:
        return f"{n / GIB:.2f} GiB"
    if abs(n) >= MIB:
        return f"{n / MIB:.1f} MiB"
    if abs(n) >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{int(n)} B"


ROWS = (
    ("params", "parameters (sharded)"),
    ("grads", "gradients (sharded)"),
    ("optimizer", "optimizer state (AdamW)"),
    ("fsdp_buffers", "FSDP buffers"),
    ("activations", "activations kept for backward"),
    ("loss_logits", "loss and logits kept for backward"),
    ("transient", "transient (largest working set)"),
)


def format_plan(plan: MemoryPlan) -> str:
    """The plan as a table, one row per item, for the rank with the highest peak."""
    s, rank = plan.settings, plan.worst_rank
    items = plan.rank_total(rank)
    compute = s.compute_dtype
    masters = "fp32 masters" if compute is not None else "in their dtype"
    notes = {
        "params": (
            f"{masters}; frozen: decoder linears in NF4 (4-bit, each rank 1/{s.shard_size}), the rest in {s.load_dtype}"
            if s.load_in_4bit
            else f"{masters}; frozen in {s.load_dtype}"
            if s.lora
            else masters
        ),
        "grads": "unsharded kept between micro-batches too"
        if items["grads"] > plan.per_rank[rank]["grads"]
        else "",
        "optimizer": "exp_avg, exp_avg_sq, step" + ("; in host memory" if s.cpu_offload else ""),
        "fsdp_buffers": plan.fsdp_note,
        "activations": f"activation_checkpointing={s.ac.mode}"
        + (f"; {plan.context.part} tokens per sequence (1/{s.cp})" if plan.context else "")
        + (f"; {human_bytes(items['host_activations'])} in host memory" if s.ac.mode == "offload" else ""),
        "loss_logits": f"chunked CE ({s.ce_chunk_tokens} tokens)" if s.ce_chunk_tokens else "fp32 log-probs",
        "transient": "logits, gradients of activations, a recomputed layer"
        + ("; the all-to-all's copies and the mask" if plan.context else "")
        + ("; one token exchange's rows (balanced routing)" if s.ep > 1 else ""),
    }
    if s.cpu_offload:
        for key in ("params", "grads", "optimizer"):
            notes[key] = "in host memory (fsdp_cpu_offload)"
    lines = [
        f"memory plan: {plan.model_name}, {plan.total_params / 1e6:.1f}M parameters "
        f"({plan.trainable_params / 1e6:.1f}M trainable); {s.describe()}"
        + (f"; {plan.layout.describe(why=False)}" if plan.layout else ""),
        f"{'item':<36} {'rank ' + str(rank):>11}  note",
    ]
    if plan.context is not None:
        lines.insert(1, plan.context.describe(human_bytes))
    if plan.float8 is not None:
        lines.insert(1, plan.float8.describe(human_bytes))
    if plan.experts is not None:
        lines[1:1] = plan.experts.describe(human_bytes)
    for key, label in ROWS:
        lines.append(f"{label:<36} {human_bytes(items[key]):>11}  {notes[key]}".rstrip())
    spread = [plan.rank_total(r)["peak"] for r in range(len(plan.per_rank))]
    lines.append(
        f"{'peak':<36} {human_bytes(items['peak']):>11}  "
        + (
            f"ranks {human_bytes(min(spread))} .. {human_bytes(max(spread))}"
            if len(set(spread)) > 1
            else "every rank"
        )
    )
    if s.cpu_offload:
        lines.append(f"{'host memory (offloaded state)':<36} {human_bytes(items['host_state']):>11}")
    return "\n".join(lines)
