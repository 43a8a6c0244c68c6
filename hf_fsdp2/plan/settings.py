"""What a memory plan is made of besides the model config: :class:`PlanSettings` (the recipe keys memory depends
on, read from a parsed recipe by :meth:`PlanSettings.from_config`), the byte units and the headroom every "fits"
uses, and :class:`PlanError`, the planner's one error."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hf_fsdp2.config.plans import ACPlan, ConfigError, LoraSettings
from hf_fsdp2.dtypes import DTYPES, MIXED_PRECISION

if TYPE_CHECKING:
    from hf_fsdp2.attention_layout import AttentionLayout
    from hf_fsdp2.config import Config

MIB = 2**20
GIB = 2**30
# The share of a GPU's memory a plan leaves free for what it does not count (the CUDA context, NCCL's buffers,
# the caching allocator's fragmentation): `hf-fsdp2 plan --headroom`'s default, the recommender's "fits" and the
# start-of-run warning all use it.
DEFAULT_HEADROOM = 0.1


class PlannedMethod(Protocol):
    """What the plan reads of a training method (:class:`hf_fsdp2.run.method.Method` is one)."""

    @property
    def batch_rows(self) -> str:
        """as_configured, corpus or padded: how its rows are laid out."""
        ...

    def rows_per_example(self, cfg: Any) -> int:
        """Rows of one example in a forward (2 for a pair; 1 for a GRPO completion)."""
        ...

    def plan_notes(self, cfg: Any, plan: Any, model_config: Any) -> list[str]:
        """Lines the plan adds: what it leaves out, other phases."""
        ...


class PlanError(ValueError):
    """A memory plan that cannot be made; the message says why and what to do."""


@dataclass(frozen=True, kw_only=True)
class PlanSettings:
    """Everything the memory of a run depends on besides the model config (the recipe keys in brackets).

    Attributes:
        world_size: processes of the run.
        dp_shard: ranks a parameter is sharded over (``dp_shard_size`` x ``cp_size``; HSDP); None = ``world_size``.
        cp: context-parallel ranks each sequence is split over (``cp_size``; all-to-all backend): they share the
            parameter shards (``cp`` divides the sharded ranks) and each runs ``1/cp`` of every sequence.
        tp: tensor-parallel ranks (``tp_size``; innermost): not modelled, the figures are FSDP2's over ``dp_shard``
            ranks, an upper bound (:meth:`describe` says so).
        ep: expert-parallel ranks (``ep_size``): each MoE layer's routed experts split over ``ep`` of the ranks a
            parameter is sharded over (innermost), each block sharded over the ``shard_size / ep`` others
            (:mod:`hf_fsdp2.plan.experts`).
        micro_batch: sequences per micro-batch per rank (``per_device_train_batch_size``).
        seq_len: tokens per sequence (``max_length``: the planned batch is full, no padding).
        ac: activation checkpointing (``activation_checkpointing``, ``ac_every_k``).
        mixed_precision: ``bf16`` (fp32 masters for trainable parameters, bf16 compute) or ``no``.
        load_dtype: ``torch_dtype`` (``auto``: the config's); frozen parameters stay in it.
        reduce_dtype: ``fsdp_reduce_dtype``.
        ce_chunk_tokens: chunked cross entropy (0 = plain logits).
        reshard_after_forward: ``fsdp_reshard_after_forward``.
        cpu_offload: ``fsdp_cpu_offload`` (parameters, gradients, AdamW state in host memory).
        device_type: ``cuda`` or ``cpu``: picks the attention kernel the forward runs.
        attn_implementation: ``attn_implementation``.
        packing: rows hold several documents (``packing``; continued pre-training's rows).
        padding_free: ``padding_free`` (None: decided as the run decides, :meth:`layout`).
        lora: the LoRA settings when ``use_peft`` (DoRA with ``use_dora``).
        load_in_4bit: ``load_in_4bit`` (QLoRA: the decoder layers' linear weights in NF4).
        layer_cls: ``fsdp_layer_cls_to_wrap`` (empty: the model's ``_no_split_modules``).
        gradient_accumulation_steps: micro-batches per step (with ``sync_each_microbatch`` false the unsharded
            gradients are kept between them).
        sync_each_microbatch: ``fsdp_sync_each_microbatch``.
        trust_remote_code: ``trust_remote_code``.
        fp8_all_gather: under ``mixed_precision=fp8``, FSDP2 all-gathers the float8 linears' weights in float8
            (``fp8_all_gather``; 1 byte per element instead of the compute dtype's).
        fp8_recipe: ``fp8_recipe`` (its size thresholds decide which linears convert).
        fp8_size_filter: ``fp8_size_filter``: linears below those thresholds stay in bf16.
        freeze_vision_tower: ``freeze_vision_tower`` (a composite's tower: no gradient or optimizer state).
        freeze_multi_modal_projector: ``freeze_multi_modal_projector``.
    """

    world_size: int = 1
    dp_shard: int | None = None
    cp: int = 1
    tp: int = 1
    ep: int = 1
    micro_batch: int = 1
    seq_len: int = 512
    ac: ACPlan = field(default_factory=ACPlan)
    mixed_precision: str = "bf16"
    load_dtype: str = "float32"
    reduce_dtype: str = "float32"
    ce_chunk_tokens: int = 1024
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    device_type: str = "cuda"
    attn_implementation: str = "auto"
    packing: bool = False
    padding_free: bool | None = False
    lora: LoraSettings | None = None
    load_in_4bit: bool = False
    layer_cls: tuple[str, ...] = ()
    gradient_accumulation_steps: int = 1
    sync_each_microbatch: bool = True
    trust_remote_code: bool = False
    fp8_all_gather: bool = True
    fp8_recipe: str = "tensorwise"
    fp8_size_filter: bool = True
    freeze_vision_tower: bool = True
    freeze_multi_modal_projector: bool = True

    def __post_init__(self) -> None:
        problems = []
        if self.world_size < 1:
            problems.append(f"world_size={self.world_size} must be >= 1")
        if self.shard_size < 1 or self.tp < 1 or self.world_size % (self.shard_size * self.tp):
            problems.append(
                f"dp_shard_size={self.dp_shard} x tp_size={self.tp} must divide world_size={self.world_size}"
            )
        if self.cp < 1 or self.shard_size % self.cp:
            problems.append(
                f"cp_size={self.cp} must divide the {self.shard_size} ranks a parameter is sharded over (dp_shard_size "
                "x cp_size): context-parallel ranks share the parameter shards"
            )
        if self.ep < 1 or self.shard_size % self.ep:
            problems.append(
                f"ep_size={self.ep} must divide the {self.shard_size} ranks a parameter is sharded over (dp_shard_size "
                "x cp_size): expert parallel borrows its ranks from them"
            )
        if self.micro_batch < 1:
            problems.append(f"per_device_train_batch_size={self.micro_batch} must be >= 1")
        if self.seq_len < 2:
            problems.append(f"max_length={self.seq_len} must be >= 2 (a next-token loss needs two tokens)")
        if self.mixed_precision not in MIXED_PRECISION:
            problems.append(
                f"mixed_precision={self.mixed_precision!r} is not one of {sorted(MIXED_PRECISION)}"
            )
        if self.load_dtype != "auto" and self.load_dtype not in DTYPES:
            problems.append(f"torch_dtype={self.load_dtype!r} is not one of auto, {', '.join(DTYPES)}")
        if self.device_type not in ("cuda", "cpu"):
            problems.append(f"device={self.device_type!r} must be cuda or cpu")
        if self.device_type == "cpu" and self.cpu_offload:
            problems.append(
                "fsdp_cpu_offload=true needs a GPU run: on cpu the parameters are in host memory already"
            )
        if self.load_in_4bit and self.lora is None:
            problems.append(
                "load_in_4bit=true needs use_peft=true (QLoRA: LoRA adapters over the 4-bit base)"
            )
        if problems:
            raise PlanError("; ".join(problems))

    @property
    def shard_size(self) -> int:
        return self.dp_shard or self.world_size

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype FSDP2 gathers and computes in; None: each parameter's own dtype."""
        return MIXED_PRECISION[self.mixed_precision]

    def shard_index(self, rank: int) -> int:
        """The rank's position on the shard dimension (Accelerate's mesh is replicate x shard x tp, row-major)."""
        return (rank // self.tp) % self.shard_size

    def replace(self, **changes: Any) -> PlanSettings:
        return dataclasses.replace(self, **changes)

    def layout(self, model_config: Any) -> AttentionLayout:
        """The batch layout and attention kernel the run takes: the run's own decision
        (:func:`hf_fsdp2.attention_layout.choose_attention_layout`), with the kernel the recipe names taken as installed
        (the plan is for the machine the run goes to; the run itself refuses a kernel it cannot load).

        Raises:
            PlanError: a kernel the model cannot run (flex_attention on a model without it).
        """
        from hf_fsdp2.attention_layout import choose_attention_layout, installed_attention_kernels

        try:
            return choose_attention_layout(
                model_config,
                device_type=self.device_type,
                attn_implementation=self.attn_implementation,
                packing=self.packing,
                padding_free=self.padding_free,
                installed=installed_attention_kernels() | {self.attn_implementation},
                trust_remote_code=self.trust_remote_code,
            )
        except ConfigError as err:
            raise PlanError(str(err)) from err

    def describe(self) -> str:
        ac = self.ac.mode + (f" (k={self.ac.every_k})" if self.ac.mode == "every_k" else "")
        replicas = self.world_size // (self.shard_size * self.tp)
        mesh = f"world {self.world_size}" + (
            f" (HSDP: {replicas} x {self.shard_size})" if replicas > 1 else ""
        )
        if self.tp > 1:
            mesh += (
                f", tensor parallel {self.tp} (not modelled: the figures are FSDP2's over {self.shard_size} ranks "
                f"without it, an upper bound; TP divides the split layers' state, their gathered copies and the "
                f"activations inside attention and the MLP by {self.tp})"
            )
        if self.cp > 1:
            mesh += (
                f", context parallel {self.cp} ({self.world_size // self.cp} data-parallel ranks, each sequence over "
                f"{self.cp} ranks)"
            )
        if self.ep > 1:
            mesh += (
                f", expert parallel {self.ep} (each rank's routed experts sharded over {self.shard_size // self.ep}; "
                "balanced routing)"
            )
        loss = f"chunked CE {self.ce_chunk_tokens}" if self.ce_chunk_tokens > 0 else "plain CE (full logits)"
        return (
            f"{mesh}, micro-batch {self.micro_batch} x {self.seq_len} tokens, mixed_precision={self.mixed_precision}, "
            f"activation_checkpointing={ac}, {loss}, device {self.device_type}"
            + (", fsdp_cpu_offload" if self.cpu_offload else "")
            + (f", {self._adapter_name()} r={self.lora.r}" if self.lora else "")
        )

    def _adapter_name(self) -> str:
        name = "DoRA" if self.lora is not None and self.lora.use_dora else "LoRA"
        return ("Q" + name + " (NF4 base)") if self.load_in_4bit else name

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        *,
        world_size: int,
        device_type: str,
        launcher: dict[str, int] | None = None,
        method: PlannedMethod | None = None,
    ) -> PlanSettings:
        """The settings of a parsed recipe for ``world_size`` processes on ``device_type``.

        Args:
            launcher: the mesh sizes accelerate launch passed (:func:`hf_fsdp2.parallel.accelerator.launcher_mesh`).
            method: the training method (its rows' layout and rows per example: 2 for a DPO pair, a GRPO group);
                None: SFT's.

        Raises:
            ConfigError: a mesh the world size cannot hold.
        """
        from hf_fsdp2.attention_layout import method_rows

        m, d, t, f = cfg.model, cfg.data, cfg.train, cfg.fsdp
        mesh = f.mesh_plan(world_size, launcher)
        batch_rows = method.batch_rows if method is not None else "as_configured"
        packing, padding_free = method_rows(d, batch_rows)  # the rows the run's layout decision reads
        rows = method.rows_per_example(cfg) if method is not None else 1
        return cls(
            world_size=world_size,
            dp_shard=mesh.fsdp_shard,  # context-parallel ranks share the parameter shards
            cp=mesh.cp,
            tp=mesh.tp,
            micro_batch=t.per_device_train_batch_size * rows,
            seq_len=d.max_length,
            ac=ACPlan(f.ac_mode(), f.ac_every_k, pin_memory=device_type == "cuda"),
            mixed_precision=t.mixed_precision,
            load_dtype=m.torch_dtype,
            reduce_dtype=f.fsdp_reduce_dtype,
            ce_chunk_tokens=t.ce_chunk_tokens,
            reshard_after_forward=f.fsdp_reshard_after_forward,
            cpu_offload=f.fsdp_cpu_offload,
            device_type=device_type,
            attn_implementation=m.attn_implementation,
            packing=packing,
            padding_free=padding_free,
            lora=cfg.peft.lora_settings() if cfg.peft.use_peft else None,
            load_in_4bit=cfg.peft.load_in_4bit,
            layer_cls=tuple(f.fsdp_layer_cls_to_wrap),
            gradient_accumulation_steps=t.gradient_accumulation_steps,
            sync_each_microbatch=f.fsdp_sync_each_microbatch,
            trust_remote_code=m.trust_remote_code,
            fp8_all_gather=t.float8_plan().all_gather if t.mixed_precision == "fp8" else True,
            fp8_recipe=t.fp8_recipe,
            fp8_size_filter=t.fp8_size_filter,
            freeze_vision_tower=m.freeze_vision_tower,
            freeze_multi_modal_projector=m.freeze_multi_modal_projector,
        )
