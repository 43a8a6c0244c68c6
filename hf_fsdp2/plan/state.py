"""The sharded state of a rank, by exact arithmetic over the parameter shapes: parameters, gradients and AdamW
state as FSDP2 splits them (:func:`state_bytes`), the ``fully_shard`` units Accelerate makes
(:func:`fsdp_units`) and the unsharded buffers their schedule keeps alive (:func:`fsdp_buffer_bytes`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hf_fsdp2.composite import composite_spec
from hf_fsdp2.dtypes import DTYPES
from hf_fsdp2.lora.quantize import is_nf4, nf4_bytes, nf4_shard_bytes
from hf_fsdp2.plan.meta_model import experts_modules, layer_classes
from hf_fsdp2.plan.settings import MIB, PlanSettings

# AdamW's ``step`` is a 0-dim fp32 tensor on the parameter's device for the fused (and capturable) kernels.
_ADAM_STEP_BYTES = 4


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


def expert_ids(model: torch.nn.Module) -> frozenset[int]:
    """Ids of the routed experts' own tensors: what ``ep_size`` splits over ``ep`` ranks."""
    return frozenset(id(p) for m in experts_modules(model) for p in m.parameters(recurse=False))


def _rows(
    param: torch.Tensor, settings: PlanSettings, index: int, experts: frozenset[int]
) -> tuple[int, int]:
    """``(held, padded)`` rows of ``param`` on the rank at shard position ``index``: a routed expert tensor under
    expert parallel is split into ``ep`` blocks of whole experts (``ep`` innermost: position ``index`` holds block
    ``index % ep``), each sharded over ``efsdp`` ranks; every other tensor over all the shard ranks."""
    rows = param.shape[0] if param.dim() else 1
    if settings.ep > 1 and id(param) in experts:
        return shard_rows(rows // settings.ep, settings.shard_size // settings.ep, index // settings.ep)
    return shard_rows(rows, settings.shard_size, index)


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
    experts = expert_ids(model) if settings.ep > 1 else frozenset()
    out = {"params": 0, "grads": 0, "optimizer": 0, "grads_unsharded": 0}
    for param in model.parameters():  # each tied parameter once, as FSDP2 shards it once
        if is_nf4(param):  # QLoRA's frozen 4-bit base: its parts split evenly by rows, no gradient
            out["params"] += nf4_shard_bytes(param, settings.shard_size, index)
            continue
        held, padded = _rows(param, settings, index, experts)
        row, size = _row_numel(param), param.element_size()
        out["params"] += padded * row * size
        if not param.requires_grad:
            continue
        out["grads"] += padded * row * size
        out["optimizer"] += 2 * held * row * size + _ADAM_STEP_BYTES
        if settings.gradient_accumulation_steps > 1 and not settings.sync_each_microbatch:
            out["grads_unsharded"] += (
                param.numel() // (settings.ep if id(param) in experts else 1) * reduce.itemsize
            )
    return out


@dataclass(frozen=True, kw_only=True)
class Unit:
    """One ``fully_shard`` call of Accelerate's FSDP2 preparation: its name and parameters (numel; trainable numel
    as a rank holds it unsharded, a routed expert tensor's ``E / ep`` block under expert parallel; unsharded bytes
    in the compute dtype), and whether it is resharded after forward."""

    name: str
    numel: int
    trainable_numel: int
    gathered_bytes: int
    reshard_after_forward: bool


def _gathered_bytes(
    param: torch.Tensor,
    settings: PlanSettings,
    float8: frozenset[int] = frozenset(),
    experts: frozenset[int] = frozenset(),
) -> int:
    """Bytes of one parameter unsharded by the all-gather: in the compute dtype (padded rows included); an NF4
    weight gathers its 4-bit codes, scales and scale factors (torchao's all-gather hooks) and dequantises per use;
    a float8 linear's weight (``float8``: their ids) 1 byte per element under ``fp8_all_gather``; a routed expert
    tensor (``experts``: their ids) under expert parallel its rank's block of ``E / ep`` experts, over ``efsdp``."""
    if is_nf4(param):
        return nf4_bytes(param)
    compute = settings.compute_dtype
    padded = _rows(param, settings, 0, experts)[1]
    ranks = settings.shard_size // (settings.ep if id(param) in experts and settings.ep > 1 else 1)
    itemsize = 1 if id(param) in float8 else compute.itemsize if compute is not None else param.element_size()
    return padded * ranks * _row_numel(param) * itemsize


def float8_weight_ids(model: torch.nn.Module, settings: PlanSettings) -> frozenset[int]:
    """Ids of the weights FSDP2 all-gathers as float8: the linears ``mixed_precision=fp8`` converts
    (:func:`hf_fsdp2.parallel.float8.plan_float8`) under ``fp8_all_gather``; empty otherwise."""
    from hf_fsdp2.parallel.float8 import plan_float8

    if settings.mixed_precision != "fp8" or not settings.fp8_all_gather:
        return frozenset()
    report = plan_float8(model, layer_classes(model, settings), settings.fp8_recipe, settings.fp8_size_filter)
    return frozenset(id(model.get_submodule(name).weight) for name in report.converted)


@dataclass(frozen=True, kw_only=True)
class Float8Traffic:
    """``mixed_precision=fp8``: the float8 weight copies and what FSDP2's all-gathers carry per optimizer step.

    Attributes:
        linears: decoder-layer linears in float8.
        weights: their weight elements (each has a float8 copy per matmul: 1 byte per element).
        gathers_per_step: all-gathers of each decoder layer per micro-batch (2 with reshard_after_forward:
            forward and backward), times the micro-batches.
        bf16_bytes: bytes one rank receives for those weights per step with a bf16 all-gather.
        fp8_bytes: the same with ``fp8_all_gather`` (equal to ``bf16_bytes`` without it).
    """

    linears: int
    weights: int
    gathers_per_step: int
    bf16_bytes: int
    fp8_bytes: int

    @property
    def saved_bytes(self) -> int:
        return self.bf16_bytes - self.fp8_bytes

    def describe(self, human: Any) -> str:
        return (
            f"FP8: {self.linears} decoder-layer linears in float8, {self.weights / 1e6:.1f}M weights (a float8 copy "
            f"of each: {human(self.weights)} when gathered); all-gather per step and rank {human(self.fp8_bytes)} "
            f"instead of {human(self.bf16_bytes)} in bf16 (saves {human(self.saved_bytes)})"
        )


def float8_traffic(model: torch.nn.Module, settings: PlanSettings) -> Float8Traffic | None:
    """The float8 counts of a ``mixed_precision=fp8`` run (None for other runs). A rank receives (shards - 1) /
    shards of each gathered weight (its own shard it has)."""
    from hf_fsdp2.parallel.float8 import plan_float8

    if settings.mixed_precision != "fp8":
        return None
    report = plan_float8(model, layer_classes(model, settings), settings.fp8_recipe, settings.fp8_size_filter)
    gathers = (2 if settings.reshard_after_forward else 1) * settings.gradient_accumulation_steps
    shards = settings.shard_size
    received = report.float8_params * (shards - 1) // shards * gathers
    return Float8Traffic(
        linears=len(report.converted),
        weights=report.float8_params,
        gathers_per_step=gathers,
        bf16_bytes=2 * received,
        fp8_bytes=received if settings.fp8_all_gather else 2 * received,
    )


def fsdp_units(model: torch.nn.Module, settings: PlanSettings) -> list[Unit]:
    """The FSDP2 units Accelerate's ``fsdp2_prepare_model`` makes: one per decoder layer, a composite's vision tower
    and projector (one unit each; on text rows they never run, so they are never gathered: 0 gathered bytes), the
    input embedding (untied), the tail (final norm + output head, + the embedding when tied; kept gathered after
    forward) and the root (everything else; kept gathered after forward)."""
    from accelerate.utils.fsdp_utils import _find_final_norm  # the very function Accelerate carves with

    from hf_fsdp2.parallel.activations import decoder_layers

    seen: set[int] = set()
    units: list[Unit] = []
    float8 = float8_weight_ids(model, settings)
    experts = expert_ids(model) if settings.ep > 1 else frozenset()

    def unsharded(param: torch.Tensor) -> int:  # elements of the parameter a rank's unit holds unsharded
        return param.numel() // (settings.ep if id(param) in experts else 1)

    def add(name: str, modules: list[torch.nn.Module], reshard: bool, runs: bool = True) -> bool:
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
                trainable_numel=sum(unsharded(p) for p in params if p.requires_grad),
                gathered_bytes=sum(_gathered_bytes(p, settings, float8, experts) for p in params)
                if runs
                else 0,
                reshard_after_forward=reshard,
            )
        )
        return True

    embed = model.get_input_embeddings()  # type: ignore[operator]
    head = model.get_output_embeddings()  # type: ignore[operator]
    tied = getattr(embed, "weight", None) is not None and getattr(embed, "weight", None) is getattr(
        head, "weight", None
    )
    layers = decoder_layers(model, layer_classes(model, settings))
    for name, layer in layers:  # wrapped first, as Accelerate does: their parameters are theirs
        add(name, [layer], settings.reshard_after_forward)
    spec = composite_spec(getattr(model, "config", None))
    if spec is not None:  # the tower's and the projector's units (Qwen's projector lies in its tower's unit)
        classes = spec.fsdp_units()[1:]
        for name, module in model.named_modules():
            if type(module).__name__ in classes:
                add(name, [module], settings.reshard_after_forward, runs=False)
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
