"""The memory a run needs on each rank, from the model config alone (``hf-fsdp2 plan``, docs/memory-plan.md).

No weight is read: the model is built with ``AutoModelForCausalLM.from_config`` on the meta device (LoRA
applied there too), and every figure comes either from arithmetic over its parameter shapes or from one
forward + backward of that meta model at the run's micro-batch shape:

- parameters, gradients, AdamW state: FSDP2 splits each parameter along dim 0 as ``torch.chunk`` does and
  stores every rank's piece in a buffer padded to the first chunk; sharded gradients are views of one padded
  reduce-scatter output per unit; AdamW's ``exp_avg`` / ``exp_avg_sq`` are the size of the rank's own
  (unpadded) piece, plus one fp32 ``step`` scalar per parameter. Exact per rank.
- FSDP buffers: unsharded parameters alive at once in the compute dtype (the tail unit and the root stay
  gathered from forward to backward; a decoder layer and the one prefetched after it) and the
  reduce-scatter buffers of the largest unit with gradients.
- activations and loss: what autograd saves for backward (``saved_tensors_hooks``, unique storages,
  parameters excluded) during the meta forward with the run's activation checkpointing applied
  (:func:`hf_fsdp2.parallel.activations.apply_activation_checkpointing`) and the run's loss path.
- transient: the largest working set above that, from the live storages of the same meta forward + backward.

The same :class:`SavedTensorMeter` measures a real run (tests/distributed/test_memory_plan.py).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hf_fsdp2.config.plans import ACPlan, ConfigError, LoraSettings
from hf_fsdp2.dtypes import DTYPES, MIXED_PRECISION

if TYPE_CHECKING:
    from hf_fsdp2.config import Config
    from hf_fsdp2.model import AttentionLayout

logger = logging.getLogger("hf_fsdp2")

MIB = 2**20
GIB = 2**30
# AdamW's ``step`` is a 0-dim fp32 tensor on the parameter's device for the fused (and capturable) kernels.
_ADAM_STEP_BYTES = 4
# Activation-checkpointing modes from the least to the most recompute (docs/performance.md measures them).
_AC_LADDER = ("none", "every_k", "selective", "full")
# Kernels transformers cannot load without their GPU packages: planned as SDPA running the GPU flash kernel,
# which saves the same tensors (query, key, value, output, logsumexp, RNG state).
# The share of a GPU's memory a plan leaves free for what it does not count (the CUDA context, NCCL's buffers,
# the caching allocator's fragmentation): `hf-fsdp2 plan --headroom`'s default, the recommender's "fits" and the
# start-of-run warning all use it.
DEFAULT_HEADROOM = 0.1
_GPU_ONLY_ATTENTION = ("flash_attention_2", "flash_attention_3", "flex_attention")


class PlanError(ValueError):
    """A memory plan that cannot be made; the message says why and what to do."""


# ---------------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanSettings:
    """Everything the memory of a run depends on besides the model config (the recipe keys in brackets).

    Attributes:
        world_size: processes of the run.
        dp_shard: ranks a parameter is sharded over (``dp_shard_size``; HSDP); None = ``world_size``.
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
        lora: the LoRA settings when ``use_peft``.
        layer_cls: ``fsdp_layer_cls_to_wrap`` (empty: the model's ``_no_split_modules``).
        gradient_accumulation_steps: micro-batches per step (with ``sync_each_microbatch`` false the unsharded
            gradients are kept between them).
        sync_each_microbatch: ``fsdp_sync_each_microbatch``.
        trust_remote_code: ``trust_remote_code``.
    """

    world_size: int = 1
    dp_shard: int | None = None
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
    layer_cls: tuple[str, ...] = ()
    gradient_accumulation_steps: int = 1
    sync_each_microbatch: bool = True
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        problems = []
        if self.world_size < 1:
            problems.append(f"world_size={self.world_size} must be >= 1")
        if self.shard_size < 1 or self.world_size % self.shard_size:
            problems.append(f"dp_shard_size={self.dp_shard} must divide world_size={self.world_size}")
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
        """The rank's position on the shard dimension (Accelerate's mesh is replicate x shard, row-major)."""
        return rank % self.shard_size

    def replace(self, **changes: Any) -> PlanSettings:
        return dataclasses.replace(self, **changes)

    def layout(self, model_config: Any) -> AttentionLayout:
        """The batch layout and attention kernel the run takes: the run's own decision
        (:func:`hf_fsdp2.model.choose_attention_layout`), with the kernel the recipe names taken as installed
        (the plan is for the machine the run goes to; the run itself refuses a kernel it cannot load).

        Raises:
            PlanError: a kernel the model cannot run (flex_attention on a model without it).
        """
        from hf_fsdp2.model import choose_attention_layout, installed_attention_kernels

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
        mesh = f"world {self.world_size}" + (
            f" (HSDP: {self.world_size // self.shard_size} x {self.shard_size})"
            if self.shard_size != self.world_size
            else ""
        )
        loss = f"chunked CE {self.ce_chunk_tokens}" if self.ce_chunk_tokens > 0 else "plain CE (full logits)"
        return (
            f"{mesh}, micro-batch {self.micro_batch} x {self.seq_len} tokens, mixed_precision={self.mixed_precision}, "
            f"activation_checkpointing={ac}, {loss}, device {self.device_type}"
            + (", fsdp_cpu_offload" if self.cpu_offload else "")
            + (f", LoRA r={self.lora.r}" if self.lora else "")
        )

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        *,
        world_size: int,
        device_type: str,
        launcher: dict[str, int] | None = None,
        recipe: str = "sft",
    ) -> PlanSettings:
        """The settings of a parsed recipe for ``world_size`` processes on ``device_type``.

        Args:
            launcher: the mesh sizes accelerate launch passed (:func:`hf_fsdp2.parallel.accelerator.launcher_mesh`).
            recipe: ``sft``, ``cpt`` (rows of ``max_length``) or ``dpo`` (one forward of the chosen and the
                rejected row of each pair: twice the rows).

        Raises:
            ConfigError: a mesh the world size cannot hold.
        """
        from hf_fsdp2.model import recipe_rows

        m, d, t, f = cfg.model, cfg.data, cfg.train, cfg.fsdp
        mesh = f.mesh_plan(world_size, launcher)
        packing, padding_free = recipe_rows(d, recipe)  # the rows the run's layout decision reads
        return cls(
            world_size=world_size,
            dp_shard=mesh.dp_shard,
            micro_batch=t.per_device_train_batch_size * (2 if recipe == "dpo" else 1),
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
            layer_cls=tuple(f.fsdp_layer_cls_to_wrap),
            gradient_accumulation_steps=t.gradient_accumulation_steps,
            sync_each_microbatch=f.fsdp_sync_each_microbatch,
            trust_remote_code=m.trust_remote_code,
        )


# ---------------------------------------------------------------------------------------------------
# The model on the meta device
# ---------------------------------------------------------------------------------------------------


def _wrap_lora(model: torch.nn.Module, lora: LoraSettings) -> torch.nn.Module:
    """PEFT LoRA on the meta model, as ``hf_fsdp2.lora.adapter.apply_lora`` wraps the real one: the base
    frozen in its dtype, the adapter (and ``modules_to_save``) fp32. (``observe`` sits below ``lora`` in the
    package graph, so the few lines are repeated here; tests/unit/test_memory_plan_cli.py compares the two.)"""
    from peft import LoraConfig, get_peft_model

    targets: list[str] | str = lora.target_modules
    if isinstance(targets, list) and targets == ["all-linear"]:
        targets = "all-linear"
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        modules_to_save=list(lora.modules_to_save) if lora.modules_to_save else None,
        use_rslora=lora.use_rslora,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        wrapped = get_peft_model(model, config, autocast_adapter_dtype=True)
    except ValueError as err:
        raise PlanError(
            f"PEFT could not apply LoRA with lora_target_modules={lora.target_modules}: {err}"
        ) from err
    for param in wrapped.parameters():
        if param.requires_grad and param.is_floating_point() and param.dtype != torch.float32:
            param.data = param.data.float()
    return wrapped


def build_meta_model(model_config: Any, settings: PlanSettings) -> torch.nn.Module:
    """The run's model on the meta device: built from its config, LoRA-wrapped when planned, trainable
    parameters in the dtype FSDP2 keeps them in (fp32 masters under mixed precision, as Accelerate upcasts).

    Raises:
        PlanError: transformers cannot build the model from this config.
    """
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model_config)
    dtype = config.dtype if settings.load_dtype == "auto" else DTYPES[settings.load_dtype]
    name = settings.attn_implementation
    attn = None if name == "auto" else ("sdpa" if name in _GPU_ONLY_ATTENTION else name)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation=attn, trust_remote_code=settings.trust_remote_code
            )
    except Exception as err:  # noqa: BLE001 - any model code's refusal (ValueError, AssertionError, ...) is the user's
        raise PlanError(
            f"cannot build {type(config).__name__} on the meta device with AutoModelForCausalLM.from_config "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); is it a causal LM whose "
            "config loads in transformers?"
        ) from err
    model.config.use_cache = False
    model.train()
    if settings.lora is not None:
        model = _wrap_lora(model, settings.lora)
    if settings.compute_dtype is not None:
        for param in model.parameters():
            if param.requires_grad and param.dtype != torch.float32:
                param.data = param.data.float()
    return model


# Config keys of a mixture of experts (experts per layer), across the families transformers ships.
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def check_plannable(model_config: Any) -> None:
    """Refuse a config whose activation memory the meta forward cannot predict.

    A mixture of experts computes each expert on the tokens the router sends it: a data-dependent split that a
    meta tensor has no values to make (the meta forward would send every token to every expert).

    Raises:
        PlanError: a MoE config, with the key that says so and what to do instead.
    """
    for key in _EXPERT_KEYS:
        experts = getattr(model_config, key, None)
        if isinstance(experts, int) and experts > 1:
            raise PlanError(
                f"{type(model_config).__name__} is a mixture of experts ({key}={experts}): which tokens each "
                "expert computes depends on the data, so its activation memory cannot be planned from the config "
                "and the planner does not plan MoE models; measure a short run instead (peak memory per step in "
                "metrics.jsonl and summary.json; memory_snapshot_steps on a GPU)"
            )


def _layer_classes(model: torch.nn.Module, settings: PlanSettings) -> tuple[str, ...]:
    from hf_fsdp2.model import decoder_layer_classes

    try:
        return decoder_layer_classes(model, list(settings.layer_cls) or None)
    except ValueError as err:
        raise PlanError(str(err)) from err


# ---------------------------------------------------------------------------------------------------
# Sharded state: parameters, gradients, AdamW (exact arithmetic)
# ---------------------------------------------------------------------------------------------------


def shard_rows(rows: int, shards: int, index: int) -> tuple[int, int]:
    """Rows of a dim-0 split that shard ``index`` holds, and the rows its buffer has.

    FSDP2 cuts dim 0 with ``torch.chunk``: chunks of ``ceil(rows / shards)`` rows, the last one shorter and
    the trailing ranks empty when the rows run out; every rank's buffer is padded to the first chunk.

    Returns:
        ``(held, padded)`` rows.
    """
    chunk = -(-rows // shards)
    start = min(rows, index * chunk)
    return min(rows, start + chunk) - start, chunk


def _row_numel(param: torch.Tensor) -> int:
    return param[0].numel() if param.dim() and param.shape[0] else 1


def state_bytes(model: torch.nn.Module, settings: PlanSettings, rank: int) -> dict[str, int]:
    """Bytes of sharded parameters, sharded gradients and AdamW state one rank holds (after a step).

    Args:
        model: from :func:`build_meta_model`.
        settings: the run.
        rank: the global rank.

    Returns:
        ``{"params", "grads", "optimizer", "grads_unsharded"}``; ``grads_unsharded`` is the extra of
        ``fsdp_sync_each_microbatch=false`` with gradient accumulation (unsharded gradients in the reduce
        dtype kept between micro-batches), else 0.
    """
    index = settings.shard_index(rank)
    reduce = DTYPES[settings.reduce_dtype]
    out = {"params": 0, "grads": 0, "optimizer": 0, "grads_unsharded": 0}
    for param in model.parameters():  # each tied parameter once, as FSDP2 shards it once
        held, padded = shard_rows(param.shape[0] if param.dim() else 1, settings.shard_size, index)
        row, size = _row_numel(param), param.element_size()
        out["params"] += padded * row * size
        if not param.requires_grad:
            continue
        out["grads"] += padded * row * size
        out["optimizer"] += 2 * held * row * size + _ADAM_STEP_BYTES
        if settings.gradient_accumulation_steps > 1 and not settings.sync_each_microbatch:
            out["grads_unsharded"] += param.numel() * reduce.itemsize
    return out


# ---------------------------------------------------------------------------------------------------
# FSDP units and their buffers
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Unit:
    """One ``fully_shard`` call of Accelerate's FSDP2 preparation: its name and parameters (numel, trainable
    numel, unsharded bytes in the compute dtype), and whether it is resharded after forward."""

    name: str
    numel: int
    trainable_numel: int
    gathered_bytes: int
    reshard_after_forward: bool


def fsdp_units(model: torch.nn.Module, settings: PlanSettings) -> list[Unit]:
    """The FSDP2 units Accelerate's ``fsdp2_prepare_model`` makes: one per decoder layer, the input embedding
    (untied), the tail (final norm + output head, + the embedding when tied; kept gathered after forward)
    and the root (everything else; kept gathered after forward)."""
    from accelerate.utils.fsdp_utils import _find_final_norm  # the very function Accelerate carves with

    from hf_fsdp2.parallel.activations import decoder_layers

    compute = settings.compute_dtype
    seen: set[int] = set()
    units: list[Unit] = []

    def add(name: str, modules: list[torch.nn.Module], reshard: bool) -> bool:
        params = []
        for module in modules:
            for param in module.parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    params.append(param)
        if not params and name != "root":
            return False
        units.append(
            Unit(
                name=name,
                numel=sum(p.numel() for p in params),
                trainable_numel=sum(p.numel() for p in params if p.requires_grad),
                gathered_bytes=sum(
                    shard_rows(p.shape[0] if p.dim() else 1, settings.shard_size, 0)[1]
                    * settings.shard_size
                    * _row_numel(p)
                    * (compute.itemsize if compute is not None else p.element_size())
                    for p in params
                ),
                reshard_after_forward=reshard,
            )
        )
        return True

    embed = model.get_input_embeddings()  # type: ignore[operator]
    head = model.get_output_embeddings()  # type: ignore[operator]
    tied = getattr(embed, "weight", None) is not None and getattr(embed, "weight", None) is getattr(
        head, "weight", None
    )
    layers = decoder_layers(model, _layer_classes(model, settings))
    for name, layer in layers:  # wrapped first, as Accelerate does: their parameters are theirs
        add(name, [layer], settings.reshard_after_forward)
    if not tied and embed is not None and add("embedding", [embed], settings.reshard_after_forward):
        units.insert(0, units.pop())  # forward order: the embedding runs first
    norm = _find_final_norm(model)
    tail = [m for m in ((norm, embed, head) if tied else (norm, head)) if m is not None]
    add("tail", tail, False)
    add("root", [model], False)
    return units


def fsdp_buffer_bytes(units: list[Unit], settings: PlanSettings) -> tuple[int, str]:
    """Unsharded parameters alive at the start of backward plus the reduce-scatter buffers of one unit.

    Gathered: the units kept after forward (tail, root; every unit without ``reshard_after_forward``) and two
    decoder layers (the one computing and the one prefetched). Reduce-scatter: the largest unit with gradients,
    its unsharded gradients in the compute dtype and the reduce-scatter input in the reduce dtype.

    Returns:
        Bytes and a one-line explanation.
    """
    kept = sum(u.gathered_bytes for u in units if not u.reshard_after_forward)
    # Units in forward order (embedding, layers); at most one computing and the next prefetched are gathered.
    order = [u.gathered_bytes for u in units if u.reshard_after_forward]
    moving = max((order[i : i + 2] for i in range(len(order))), key=sum, default=[])
    compute = settings.compute_dtype
    grad_item = (compute.itemsize if compute is not None else 4) + DTYPES[settings.reduce_dtype].itemsize
    reduce = max((u.trainable_numel for u in units), default=0) * grad_item
    note = (
        f"gathered: {kept / MIB:.1f} MiB kept after forward (tail, root"
        + ("" if settings.reshard_after_forward else ", every layer: reshard_after_forward=false")
        + f") + {sum(moving) / MIB:.1f} MiB for {len(moving)} units in flight; "
        f"reduce-scatter {reduce / MIB:.1f} MiB"
    )
    return kept + sum(moving) + reduce, note


# ---------------------------------------------------------------------------------------------------
# Saved tensors: the meter (meta prediction and real measurement alike)
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SavedBytes:
    """Bytes autograd holds for backward after a forward (unique storages, parameters excluded).

    Attributes:
        activations: saved by the model up to the output head, on the device.
        loss: saved from the output head on (its input, the chunked loss's gradients or the log-probs).
        offloaded: what ``activation_checkpointing=offload`` copies to host memory (the inputs of the
            checkpointed layers, one copy per layer); counted only by ``result(offload_layer_inputs=True)``.
    """

    activations: int
    loss: int
    offloaded: int = 0


@dataclass
class _Saved:
    ref: StorageWeakRef
    places: set[str]


class _SelectiveCache(TorchDispatchMode):
    """Sees the outputs selective checkpointing keeps: its policy caches them in the checkpoint, not through
    ``saved_tensors_hooks``, so the meter asks the same policy (:func:`selective_policy`) inside such a layer."""

    def __init__(self, meter: SavedTensorMeter) -> None:
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.utils.checkpoint import CheckpointPolicy

        from hf_fsdp2.parallel.activations import selective_policy

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        layers = self.meter._layers
        selective = bool(layers) and layers[-1] == "selective" and self.meter._place == "body"
        if selective and selective_policy(None, func, *args, **kwargs) == CheckpointPolicy.MUST_SAVE:
            for value in tree_flatten(out)[0]:
                if isinstance(value, torch.Tensor):
                    self.meter._record(value, "cached")
        return out


def _decoder_layers(model: torch.nn.Module, layer_cls: tuple[str, ...]) -> list[torch.nn.Module]:
    """The decoder layers, sharded or not (FSDP2 makes each an instance of a subclass ``FSDP<class>``)."""
    found: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        inside = any(name.startswith(f + ".") for f, _ in found)
        if not inside and any(c.__name__ in layer_cls for c in type(module).__mro__):
            found.append((name, module))
    return [module for _, module in found]


class SavedTensorMeter:
    """Count what autograd keeps for backward during a forward.

    Every tensor saved through ``saved_tensors_hooks`` is remembered (its storage, weakly) with where it was
    saved: in a decoder layer's call, elsewhere in the model, or from the output head on (the loss). Activation
    checkpointing saves through hooks of its own inside a checkpointed layer, so such a layer shows the inputs
    the checkpoint keeps; under ``selective`` the outputs its policy keeps are counted too (they are cached in
    the checkpoint, not saved through hooks). After the forward, :meth:`result` sums the storages still alive
    at their current size, parameters left out (a gathered FSDP2 parameter that was resharded has size 0).

    Args:
        model: the model (sharded or not, real or meta).
        layer_cls: decoder-layer class names.
    """

    def __init__(self, model: torch.nn.Module, layer_cls: tuple[str, ...]) -> None:
        self.model = model
        self.layer_cls = layer_cls
        self._saved: dict[int, _Saved] = {}
        self._place = "body"
        self._layers: list[str] = []  # checkpointing mode of each decoder layer being called
        self._host = 0
        self._stack = ExitStack()

    def _record(self, tensor: torch.Tensor, place: str) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        entry = self._saved.get(key)
        if entry is None or entry.ref.expired():
            entry = self._saved[key] = _Saved(StorageWeakRef(storage), set())
        entry.places.add(place)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        place = "layer" if self._layers and self._place == "body" else self._place
        self._record(tensor, place)
        if place == "layer":  # save_on_cpu copies each tensor saved there, views included
            self._host += tensor.numel() * tensor.element_size()
        return tensor

    def __enter__(self) -> SavedTensorMeter:
        def enter(layer: torch.nn.Module, *_: Any) -> None:
            self._layers.append(getattr(layer.forward, "__hf_fsdp2_checkpointed__", None) or "none")

        def leave(*_: Any) -> None:
            self._layers.pop()

        def to_loss(*_: Any) -> None:
            self._place = "loss"

        for layer in _decoder_layers(self.model, self.layer_cls):
            self._stack.callback(layer.register_forward_pre_hook(enter).remove)
            self._stack.callback(layer.register_forward_hook(leave).remove)
        head = self.model.get_output_embeddings()  # type: ignore[operator]
        if head is None:
            raise PlanError(f"{type(self.model).__name__} has no output head (get_output_embeddings)")
        # prepend: the loss phase starts before the chunked loss's own pre-hook computes inside the head.
        self._stack.callback(head.register_forward_pre_hook(to_loss, prepend=True).remove)
        self._stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t))
        self._stack.enter_context(_SelectiveCache(self))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def result(self, *, offload_layer_inputs: bool = False) -> SavedBytes:
        """The bytes kept and still alive (call after the forward, before backward).

        Args:
            offload_layer_inputs: count what only the decoder layers' calls saved as host memory (the
                prediction of ``offload`` from a ``full`` forward: save_on_cpu takes exactly those).
        """
        params = {p.untyped_storage()._cdata for p in self.model.parameters()}
        body = loss = 0
        for key, entry in self._saved.items():
            if key in params or entry.ref.expired():
                continue
            nbytes = torch.UntypedStorage._new_with_weak_ptr(entry.ref.cdata).nbytes()
            if offload_layer_inputs and entry.places == {"layer"}:
                continue
            if entry.places == {"loss"}:
                loss += nbytes
            else:
                body += nbytes
        return SavedBytes(body, loss, self._host if offload_layer_inputs else 0)


# ---------------------------------------------------------------------------------------------------
# The meta forward + backward
# ---------------------------------------------------------------------------------------------------


class _MetaForward(TorchFunctionMode):
    """Let a transformers forward run on meta tensors as it runs on the device.

    A meta tensor has no values: the data-dependent checks of the mask code (is there padding? packed
    sequences?) read as True, as they do for the planned batch (full rows, one sequence each). SDPA on meta
    decomposes into the math kernel (which saves the attention probabilities); it is sent to the kernel the
    device picks instead: ``flash_attention_for_cpu`` on CPU; on a GPU flash attention, or memory-efficient
    attention with a mask or a head dim over 256 (each saves query, key, value, output and logsumexp).
    """

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.__bool__ and args[0].is_meta:
            return True
        if func is F.scaled_dot_product_attention and args[0].is_meta:
            out = self._attention(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)

    def _attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor | None:
        aten = torch.ops.aten
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            # As scaled_dot_product_attention does before any kernel: a new additive mask in the query's dtype,
            # per call (the memory-efficient kernel keeps it for backward: one per layer).
            zero = torch.zeros((), dtype=query.dtype, device=query.device)
            attn_mask = torch.where(attn_mask, zero, torch.full_like(zero, float("-inf")))
        if self.device_type == "cpu":
            if dropout_p:
                return None  # the CPU picks the math kernel with dropout, as the meta decomposition does
            return aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
            )[0]
        if attn_mask is None and query.shape[-1] <= 256:
            return aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale
            )[0]
        if key.shape[1] != query.shape[1]:  # memory-efficient attention takes no grouped KV heads
            repeat = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
        return aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale
        )[0]


def _under_meta_forward(forward: Any, device_type: str) -> Any:
    """``forward`` run under :class:`_MetaForward`: a checkpointed layer recomputes in backward, where the
    autograd engine does not carry torch-function modes, so each layer enters its own."""

    def run(*args: Any, **kwargs: Any) -> Any:
        with _MetaForward(device_type):
            return forward(*args, **kwargs)

    return run


class _LiveBytes(TorchDispatchMode):
    """The largest total of live storages that ops created (parameters and their storages excluded)."""

    def __init__(self, exclude: set[int]) -> None:
        super().__init__()
        self.exclude = exclude
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                key = storage._cdata
                if key not in self.exclude and key not in self.live:
                    self.live[key] = (StorageWeakRef(storage), storage.nbytes())
                    self.current += storage.nbytes()
        # ``current`` still counts the storages that died since the last sweep, so it bounds the live total from
        # above: only a bound over the peak needs the sweep (exact, and linear rather than quadratic in ops).
        # A weak reference keeps its storage's address, so a dead entry's key is never reused meanwhile.
        if self.current > self.peak:
            for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
                self.current -= self.live.pop(key)[1]
            self.peak = max(self.peak, self.current)
        return out


@dataclass(frozen=True)
class ComputeBytes:
    """What one micro-batch's forward + backward needs besides the sharded state and the FSDP buffers."""

    saved: SavedBytes
    peak: int  # the largest total of live tensors during forward + backward (saved ones included)

    @property
    def transient(self) -> int:
        return max(0, self.peak - self.saved.activations - self.saved.loss)


def _chunked_loss_possible(model: torch.nn.Module) -> bool:
    head = model.get_output_embeddings()  # type: ignore[operator]
    return (
        isinstance(head, torch.nn.Module)
        and getattr(head, "weight", None) is not None
        and getattr(head, "bias", None) is None
    )


def _param_dtype(model: torch.nn.Module) -> torch.dtype:
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def _planned_inputs(
    ids: torch.Tensor, layout: AttentionLayout, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The forward's inputs for the planned rows. Rows of several documents carry restarting ``position_ids``
    and no ``attention_mask``; on meta the packed-sequence check of transformers' masking_utils cannot read them
    (no values), so where the run's kernel gets a dense mask it is handed here, the mask transformers builds:
    ``[rows, 1, T, T]``, bool for sdpa (``sdpa_mask``), the compute dtype for eager (``eager_mask``)."""
    if not (layout.padding_free or layout.packing):
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    inputs = {"input_ids": ids, "position_ids": torch.zeros_like(ids)}
    if layout.dense_mask:
        rows, tokens = ids.shape
        mask_dtype = torch.bool if layout.kernel == "sdpa" else dtype
        inputs["attention_mask"] = torch.zeros((rows, 1, tokens, tokens), dtype=mask_dtype, device=ids.device)
    return inputs


def compute_bytes(model_config: Any, settings: PlanSettings) -> ComputeBytes:
    """Run one forward + backward of the meta model at the run's micro-batch shape and count its memory.

    Activation checkpointing is the toolkit's own, applied as the run applies it; ``offload`` is planned from
    a ``full`` forward whose layer inputs go to host memory. Every parameter is cast to the compute dtype (what
    FSDP2's mixed-precision policy gathers); a parameter's gradient is dropped as soon as it is accumulated,
    as FSDP2 reduce-scatters it (the buffers of that are in :func:`fsdp_buffer_bytes`).

    Raises:
        PlanError: the model cannot run on the meta device (data-dependent code such as MoE routing).
    """
    import torch.fx.experimental._config as fx_config

    from hf_fsdp2.parallel.activations import apply_activation_checkpointing, decoder_layers
    from hf_fsdp2.train.loss import LossPlan, causal_lm_loss, logit_transform_for, router_aux_coef

    check_plannable(model_config)
    model = build_meta_model(model_config, settings)
    layer_cls = _layer_classes(model, settings)
    for _, layer in decoder_layers(model, layer_cls):
        layer.forward = _under_meta_forward(layer.forward, settings.device_type)
    offload = settings.ac.mode == "offload"
    plan = ACPlan("full", settings.ac.every_k, pin_memory=False) if offload else settings.ac
    try:
        apply_activation_checkpointing(model, plan, layer_cls)
    except ValueError as err:
        raise PlanError(str(err)) from err
    compute = settings.compute_dtype
    for param in model.parameters():
        if compute is not None and param.dtype != compute:
            param.data = param.data.to(compute)
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    chunk = settings.ce_chunk_tokens if _chunked_loss_possible(model) else 0
    loss_plan = LossPlan(chunk, logit_transform_for(model.config), router_aux_coef(model.config))
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    layout = settings.layout(model_config)
    # Padding-free: the micro-batch is one row of all its tokens (so a dense mask is [1, 1, T, T] over all of them).
    shape = (
        (1, settings.micro_batch * settings.seq_len)
        if layout.padding_free
        else (settings.micro_batch, settings.seq_len)
    )
    live = _LiveBytes(params)
    meter = SavedTensorMeter(model, layer_cls)
    try:
        # Data-dependent sizes (nonzero: the rows with a target) read as "every element": the planned batch
        # is full rows, every token a target.
        with _MetaForward(settings.device_type), live, fx_config.patch(meta_nonzero_assume_all_nonzero=True):  # type: ignore[attr-defined]
            ids = torch.zeros(shape, dtype=torch.long, device="meta")
            inputs = _planned_inputs(ids, layout, compute or _param_dtype(model))
            with meter:
                out = causal_lm_loss(model, inputs, ids, loss_plan)
            saved = meter.result(offload_layer_inputs=offload)
            on_device = meter.result()
            total = out.ce_sum if out.aux_loss is None else out.ce_sum + out.aux_loss
            del out
            total.backward()
    except (RuntimeError, NotImplementedError) as err:
        raise PlanError(
            f"{type(model).__name__} cannot run its forward on the meta device ({str(err).splitlines()[0]}); "
            "the activation memory of this model cannot be planned (data-dependent code such as MoE routing)"
        ) from err
    # offload: the forward ran as full, whose layer inputs the run keeps in host memory instead (one comes back
    # at a time for its recompute, as full's working set already counts).
    return ComputeBytes(saved, live.peak - (on_device.activations - saved.activations))


# ---------------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
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
            "transient": self.compute.transient,
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
                "dp_shard_size": s.shard_size,
                "per_device_train_batch_size": s.micro_batch,
                "max_length": s.seq_len,
                "activation_checkpointing": s.ac.mode,
                "ac_every_k": s.ac.every_k,
                "mixed_precision": s.mixed_precision,
                "ce_chunk_tokens": s.ce_chunk_tokens,
                "fsdp_cpu_offload": s.cpu_offload,
                "gradient_accumulation_steps": s.gradient_accumulation_steps,
                "device": s.device_type,
                "use_peft": s.lora is not None,
                "packing": s.packing,
                "padding_free": None if self.layout is None else self.layout.padding_free,
                "attention": None if self.layout is None else self.layout.kernel,
                "dense_mask": None if self.layout is None else self.layout.dense_mask,
            },
            "worst_rank": self.worst_rank,
            "peak": self.peak,
            "ranks": [self.rank_total(r) for r in range(len(self.per_rank))],
            "units": [dataclasses.asdict(u) for u in self.units],
        }


def plan_memory(model_config: Any, settings: PlanSettings) -> MemoryPlan:
    """The per-rank memory of a run of ``model_config`` with ``settings`` (no weights read).

    Raises:
        PlanError: a model or setting that cannot be planned, with the reason.
    """
    check_plannable(model_config)
    model = build_meta_model(model_config, settings)
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
        layout=settings.layout(model_config),
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


_ROWS = (
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
        "params": f"{masters}; frozen in {s.load_dtype}" if s.lora else masters,
        "grads": "unsharded kept between micro-batches too"
        if items["grads"] > plan.per_rank[rank]["grads"]
        else "",
        "optimizer": "exp_avg, exp_avg_sq, step" + ("; in host memory" if s.cpu_offload else ""),
        "fsdp_buffers": plan.fsdp_note,
        "activations": f"activation_checkpointing={s.ac.mode}"
        + (f"; {human_bytes(items['host_activations'])} in host memory" if s.ac.mode == "offload" else ""),
        "loss_logits": f"chunked CE ({s.ce_chunk_tokens} tokens)" if s.ce_chunk_tokens else "fp32 log-probs",
        "transient": "logits, gradients of activations, a recomputed layer",
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
    for key, label in _ROWS:
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


# ---------------------------------------------------------------------------------------------------
# Recommendation
# ---------------------------------------------------------------------------------------------------


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
        labels = dict(_ROWS)
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


# ---------------------------------------------------------------------------------------------------
# Start of a run, and the command
# ---------------------------------------------------------------------------------------------------


def read_model_config(
    model_name_or_path: str,
    *,
    model_config: str | Path | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
) -> Any:
    """The config the plan is made from: ``model_config`` (a config.json file, or a folder holding one) when
    given, else the recipe's ``model_name_or_path`` (a local folder, or a hub id read from the hub's cache).

    Raises:
        PlanError: no config can be read; the message names the source and the fix.
    """
    from transformers import AutoConfig

    from hf_fsdp2.model import load_model_config

    if model_config is not None:
        path = Path(model_config).expanduser()
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise PlanError(
                f"--model_config {str(model_config)!r}: no such file; give a model's config.json or a folder "
                "holding one"
            )
        try:
            return AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        except (OSError, ValueError, KeyError) as err:
            raise PlanError(
                f"--model_config {str(model_config)!r} is not a transformers config.json: {err}"
            ) from err
    try:
        return load_model_config(model_name_or_path, revision=revision, trust_remote_code=trust_remote_code)
    except FileNotFoundError as err:
        raise PlanError(str(err)) from err
    except (OSError, ValueError) as err:
        raise PlanError(
            f"model_name_or_path={model_name_or_path!r} is no local folder here, and read as a hub id its "
            f"config.json could not be fetched ({str(err).splitlines()[0]}; offline: HF_HUB_OFFLINE=1, or no "
            "network). Give the config another way: --model_config path/to/config.json (or a local model "
            "folder), or --model_name_or_path <local folder>"
        ) from err


def recipe_notes(cfg: Config, recipe: str) -> list[str]:
    """What the plan of ``recipe`` leaves out, one line each (empty for SFT and CPT)."""
    if recipe == "dpo" and not (cfg.preference.precompute_ref_log_probs or cfg.peft.use_peft):
        return [
            "not planned: DPO's reference model (a frozen sharded copy of the policy, its gathered layers during "
            "its forward); precompute_ref_log_probs: true or use_peft: true trains without one"
        ]
    return []


def _describe_error(err: Exception) -> str:
    text = str(err).splitlines()[0] if str(err) else ""
    return text if isinstance(err, (PlanError, ConfigError)) else f"{type(err).__name__}: {text}"


def memory_warning(peak: int, total: int, world_size: int, headroom: float = DEFAULT_HEADROOM) -> str | None:
    """The start-of-run warning when the predicted ``peak`` does not fit a GPU of ``total`` bytes as
    ``hf-fsdp2 plan`` says "fits" (at most ``(1 - headroom) x total``), else None."""
    limit = total * (1 - headroom)
    if peak <= limit:
        return None
    return (
        f"the predicted peak {human_bytes(peak)} per rank exceeds {1 - headroom:.0%} of this GPU's {human_bytes(total)} "
        f"({human_bytes(limit)}; the rest is kept for the CUDA context, NCCL and fragmentation): the run will "
        f"likely fail with out-of-memory; `hf-fsdp2 plan --config <recipe> --world_size {world_size} "
        f"--gpu_memory {total // GIB}GiB` lists settings that fit"
    )


def log_run_plan(
    cfg: Config, model_config: Any, *, world_size: int, device: torch.device, recipe: str = "sft"
) -> MemoryPlan | None:
    """Log the plan of the run starting now, and warn when its peak does not fit the GPU with the recommender's
    headroom (:func:`memory_warning`).

    Call it on rank 0 only: it runs no collective and reads no weight (a meta model at the run's shape), and the
    global RNG state is restored after it. It never fails the run: anything that stops the plan is logged as one
    warning line and ``None`` returned (the plan is advice, not a check). ``recipe="dpo"`` plans the policy's
    forward of 2 rows per pair; the DPO reference model is not in the plan (the log says so).

    Returns:
        The plan, or None when it could not be made.
    """
    from hf_fsdp2.parallel.accelerator import launcher_mesh

    try:
        with torch.random.fork_rng(devices=[]):
            settings = PlanSettings.from_config(
                cfg, world_size=world_size, device_type=device.type, launcher=launcher_mesh(), recipe=recipe
            )
            plan = plan_memory(model_config, settings)
    except Exception as err:  # noqa: BLE001 - advice only: the run goes on whatever the planner meets
        logger.warning("memory plan unavailable (the run goes on): %s", _describe_error(err))
        return None
    for line in [*format_plan(plan).splitlines(), *recipe_notes(cfg, recipe)]:
        logger.info(line)
    if device.type == "cuda":
        warning = memory_warning(plan.peak, torch.cuda.get_device_properties(device).total_memory, world_size)
        if warning:
            logger.warning(warning)
    return plan


__all__ = [
    "Candidate",
    "ComputeBytes",
    "DEFAULT_HEADROOM",
    "MemoryPlan",
    "PlanError",
    "PlanSettings",
    "SavedBytes",
    "SavedTensorMeter",
    "Unit",
    "build_meta_model",
    "check_plannable",
    "compute_bytes",
    "format_plan",
    "format_recommendation",
    "fsdp_buffer_bytes",
    "fsdp_units",
    "human_bytes",
    "log_run_plan",
    "memory_warning",
    "plan_memory",
    "read_model_config",
    "recipe_notes",
    "recommend",
    "shard_rows",
    "state_bytes",
]
