"""QLoRA's frozen base: the decoder layers' linear weights in NF4 (4-bit NormalFloat, double-quantised scales),
sharded by FSDP2 like any other parameter.

Mechanism: torchao's ``NF4Tensor`` (docs/qlora.md says why). It is a tensor subclass that FSDP2 shards along dim 0
(its 4-bit codes, its 8-bit block scales and their scale factors split evenly between the ranks, so each rank holds
1/world of the 4-bit bytes) and all-gathers through its ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` hooks:
the all-gather moves 4-bit codes, not bf16 weights. ``F.linear`` on it dequantises to the input's dtype (the run's
compute dtype) in the forward and in the backward; the weight has no gradient. PEFT's LoRA wraps the quantised
``nn.Linear`` as it wraps any other.

Which weights: every ``nn.Linear`` inside a decoder layer (attention and MLP projections), as
``BitsAndBytesConfig(load_in_4bit=True)`` quantises them; embeddings, norms and the output head stay in the loaded
dtype (the head is bnb's default ``llm_int8_skip_modules``). On a composite checkpoint, the language model's decoder
layers only: the vision tower and the projector keep their dtype (frozen, never run on text rows). Block size 64 (QLoRA's); the scales are quantised per
256 (QLoRA's double quantisation) unless a weight's scale count needs a smaller block for an even split over the
ranks (logged; e.g. SmolLM2's 192 x 576 key projection on 2 ranks).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger("hf_fsdp2")

NF4_BLOCK_SIZE = 64  # weights per absmax scale (QLoRA's)
NF4_SCALER_BLOCK_SIZE = 256  # scales per second-level scale factor (QLoRA's double quantisation)
QUANT_TYPES = ("nf4",)


class QuantizationError(ValueError):
    """A 4-bit setting or model the run cannot quantise; the message says why and what to do."""


def _nf4_class() -> type:
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor
    except ImportError as err:
        raise QuantizationError(
            f"load_in_4bit=true needs torchao's NF4 tensor ({err}); pip install 'hf_fsdp2[qlora]' "
            "(torchao>=0.18)"
        ) from err
    return NF4Tensor


def _peft_dequantize(nf4_type: type) -> None:
    """Make ``weight.dequantize()`` return the dequantised weight, as PEFT expects of torchao tensors.

    PEFT's DoRA computes its weight norm through ``dequantize_module_weight``, which calls ``weight.dequantize()``
    on any torchao tensor; torchao's NF4 tensor has a static ``dequantize(value, nf4)`` (its lookup-table step)
    instead. The replacement answers both: with no argument it dequantises the whole weight, with the two it is
    torchao's own step (its callers pass them)."""
    original = nf4_type.__dict__.get("dequantize")
    if getattr(original, "_hf_fsdp2", False):
        return
    # Guard (docs/compatibility.md): torchao's static two-argument step and get_original_weight, as 0.18 has them.
    if not isinstance(original, staticmethod) or not callable(getattr(nf4_type, "get_original_weight", None)):
        raise QuantizationError(
            f"torchao's NF4Tensor.dequantize is {original!r}, not the static dequantize(value, nf4) of the torchao "
            "hf_fsdp2 is tested on (with get_original_weight()): PEFT's DoRA and LoRA paths would call a changed "
            "API. Install the torchao docs/compatibility.md lists (pip install 'torchao==0.18.*')"
        )
    lookup = original.__func__

    def dequantize(*args: torch.Tensor) -> torch.Tensor:
        if len(args) == 1:  # weight.dequantize(): PEFT's call
            return args[0].get_original_weight()  # type: ignore[attr-defined,no-any-return]
        return lookup(*args[-2:])  # type: ignore[no-any-return]  # self.dequantize(value, nf4) or the class's

    dequantize._hf_fsdp2 = True  # type: ignore[attr-defined]
    nf4_type.dequantize = dequantize  # type: ignore[attr-defined]


def _single_rank_all_gather(nf4_type: type) -> None:
    """Let FSDP2 unshard an NF4 weight when its shard group has one rank (a one-GPU QLoRA run).

    With one rank, FSDP2 skips the all-gather and copies the first all-gather input alone into the unsharded buffer
    (torch 2.13's ``FSDPParamGroup.wait_for_unshard``); the NF4 tensor has three (scales, scale factors, codes), so
    the first forward failed ("not enough values to unpack (expected 3, got 1)"). With one rank the hooks here hand
    FSDP2 one byte buffer holding the three parts (the widest dtype first, so each view is aligned) and rebuild the
    NF4 tensor on views of it, the buffer being what FSDP2 frees and reallocates; with more ranks they are torchao's
    own, unchanged. tests/distributed/test_memory_plan.py runs a QLoRA model at world 1 and 2."""
    pre, post = nf4_type.__dict__.get("fsdp_pre_all_gather"), nf4_type.__dict__.get("fsdp_post_all_gather")
    if getattr(pre, "_hf_fsdp2", False):
        return
    problem = single_rank_hooks_problem(pre, post)
    if (
        problem
    ):  # Guard (docs/compatibility.md): hooks of another shape are left as they are, and the run says so
        logger.warning(
            "QLoRA: torchao's NF4 all-gather hooks are not patched for one-rank shard groups (%s); a world-size-1 "
            "QLoRA run may fail at its first forward ('not enough values to unpack'). Install the torchao "
            "docs/compatibility.md lists (pip install 'torchao==0.18.*') or run on 2+ ranks",
            problem,
        )
        return
    assert pre is not None and post is not None  # single_rank_hooks_problem checked them

    def fsdp_pre_all_gather(self: torch.Tensor, mesh: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        inputs, metadata = pre(self, mesh)
        if mesh.get_group().size() != 1:
            return inputs, metadata
        order = sorted(range(len(inputs)), key=lambda i: -inputs[i].element_size())
        layout = [(i, inputs[i].dtype, inputs[i].shape) for i in order]
        packed = torch.cat([inputs[i].reshape(-1).view(torch.uint8) for i in order])
        return (packed,), ("hf_fsdp2_packed", metadata, layout)

    def fsdp_post_all_gather(
        self: torch.Tensor,
        outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> Any:
        if not (isinstance(metadata, tuple) and metadata and metadata[0] == "hf_fsdp2_packed"):
            return post(self, outputs, metadata, param_dtype, out=out)
        _, inner, layout = metadata
        (packed,) = outputs
        parts: list[torch.Tensor] = [packed] * len(layout)
        offset = 0
        for index, dtype, shape in layout:
            size = shape.numel() * dtype.itemsize
            parts[index] = packed[offset : offset + size].view(dtype).view(shape)
            offset += size
        result = post(self, tuple(parts), inner, param_dtype, out=out)
        return None if out is not None else (result[0], (packed,))

    fsdp_pre_all_gather._hf_fsdp2 = True  # type: ignore[attr-defined]
    nf4_type.fsdp_pre_all_gather = fsdp_pre_all_gather  # type: ignore[attr-defined]
    nf4_type.fsdp_post_all_gather = fsdp_post_all_gather  # type: ignore[attr-defined]


def single_rank_hooks_problem(pre: Any, post: Any) -> str | None:
    """Why torchao's FSDP2 hooks ``pre`` / ``post`` are not the ones :func:`_single_rank_all_gather` wraps (None: they
    are): ``fsdp_pre_all_gather(self, mesh)`` and ``fsdp_post_all_gather(self, outputs, metadata, param_dtype, *,
    out)`` as torchao 0.18 defines them, the pre-hook handing FSDP2 the three parts the wrapper packs."""
    import inspect

    if not callable(pre) or not callable(post):
        return f"fsdp_pre_all_gather={pre!r}, fsdp_post_all_gather={post!r}"
    pre_args = list(inspect.signature(pre).parameters)
    post_params = inspect.signature(post).parameters
    if pre_args != ["self", "mesh"]:
        return f"fsdp_pre_all_gather takes {pre_args}, not ['self', 'mesh']"
    if (
        list(post_params)[:4] != ["self", "all_gather_outputs", "metadata", "param_dtype"]
        or "out" not in post_params
    ):
        return f"fsdp_post_all_gather takes {list(post_params)}, not (self, all_gather_outputs, metadata, param_dtype, *, out)"
    return None


def is_nf4(tensor: torch.Tensor) -> bool:
    """True for an NF4 weight (sharded or not)."""
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return type(local).__name__ == "NF4Tensor"


def scaler_block_for(numel: int, rows: int, shards: int) -> int | None:
    """The scale block of a ``rows``-row weight of ``numel`` elements that ``shards`` ranks can split evenly.

    FSDP2 splits the weight's rows, and with them each of the NF4 tensor's flat parts: ``numel / 2`` code bytes,
    ``numel / 64`` scales and ``numel / 64 / scaler_block`` scale factors; each must divide by ``shards``.
    QLoRA's 256 when it can, else the largest power of two below it that can; None when none can.
    """
    if numel % NF4_BLOCK_SIZE or rows % shards or (numel // 2) % shards:
        return None
    scales = numel // NF4_BLOCK_SIZE
    block = NF4_SCALER_BLOCK_SIZE
    while block >= 1:
        if scales % block == 0 and (scales // block) % shards == 0:
            return block
        block //= 2
    return None


@dataclass(kw_only=True)
class QuantReport:
    """What :func:`quantize_base` did: weights quantised, their bytes before and after, smaller scale blocks."""

    weights: int = 0
    source_bytes: int = 0  # the quantised weights in their loaded dtype
    nf4_bytes: int = 0  # the same weights in NF4: codes + quantised scales + scale factors (all ranks)
    kept_bytes: int = 0  # every other parameter, in its dtype
    small_scaler_blocks: dict[str, int] = field(default_factory=dict)

    def describe(self, shards: int) -> str:
        return (
            f"4-bit base (NF4, double-quantised scales): {self.weights} linear weights of the decoder layers, "
            f"{self.source_bytes / 2**20:.1f} MiB -> {self.nf4_bytes / 2**20:.1f} MiB "
            f"({self.nf4_bytes / 2**20 / shards:.2f} MiB per rank over {shards}); other parameters "
            f"{self.kept_bytes / 2**20:.1f} MiB in their dtype"
        )


_SHARDED_PARTS = (
    "quantized_data",
    "quantized_scalers",
    "quantization_factor",
)  # split by rows; the rest whole


def nf4_shard_bytes(weight: torch.Tensor, shards: int, index: int) -> int:
    """Bytes shard ``index`` of ``shards`` holds of an (unsharded, possibly meta) NF4 weight once FSDP2 shards it:
    1/shards of its codes, scales and scale factors (:func:`quantize_base` made each split evenly, so no padding),
    and its own copy of the per-tensor scale mean and 16-entry lookup table. The memory plan's figure
    (tests/distributed/test_memory_plan.py holds it to the storages a real run's ranks hold)."""
    del index  # every shard is the same size: the split is even
    names, _ = weight.__tensor_flatten__()  # type: ignore[attr-defined]
    total = 0
    for name in names:
        part = getattr(weight, name)
        size = part.numel() * part.element_size()
        total += size // shards if name in _SHARDED_PARTS else size
    return total


def nf4_bytes(tensor: torch.Tensor) -> int:
    """Bytes an NF4 tensor (or this rank's shard of one) holds: codes, quantised scales, scale factors."""
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return sum(getattr(local, name).numel() * getattr(local, name).element_size() for name in _SHARDED_PARTS)


def quantize_base(
    model: torch.nn.Module,
    layer_cls: tuple[str, ...],
    *,
    shards: int,
    skip: tuple[str, ...] = (),
    meta_ok: bool = False,
) -> QuantReport:
    """Replace the weight of every ``nn.Linear`` inside a decoder layer by its NF4 tensor, frozen, in place.

    Call it on the loaded, unsharded model before LoRA wraps it and before FSDP2 shards it.

    Args:
        model: the causal LM (real weights, not meta).
        layer_cls: decoder-layer class names (``model.decoder_layer_classes``).
        shards: ranks each weight is sharded over (the FSDP shard group): each part must split evenly.
        skip: module-name suffixes left unquantised (``lora_modules_to_save``: they train in full).
        meta_ok: quantise meta weights too (the memory plan's meta model: NF4 tensors of the right sizes, no
            values); a run refuses them (rank-0-only loading leaves the other ranks' weights on meta).

    Returns:
        The :class:`QuantReport`.

    Raises:
        QuantizationError: no torchao; meta weights; a weight whose size cannot be split over ``shards``; a fused
            3-D expert tensor (MoE), which NF4 cannot hold.
    """
    nf4_type = _nf4_class()
    _peft_dequantize(nf4_type)
    _single_rank_all_gather(nf4_type)
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    from hf_fsdp2.lora.build import composite_parts, under

    report = QuantReport()
    meta_templates: dict[tuple[Any, ...], torch.Tensor] = {}
    # A composite's vision tower and projector stay in their dtype, frozen (and carried byte-identical by the
    # export), whichever classes are named: only its language model's layers are quantised.
    parts = composite_parts(model)
    layers = [m for n, m in model.named_modules() if type(m).__name__ in layer_cls and not under(parts, n)]
    if not layers:
        raise QuantizationError(f"no decoder layer of classes {list(layer_cls)} in {type(model).__name__}")
    quantised: set[int] = set()
    for layer in layers:
        for pname, param in layer.named_parameters():
            if param.dim() > 2 and param.is_floating_point():
                raise QuantizationError(
                    f"load_in_4bit=true: {type(model).__name__} holds fused expert weights ({pname}, shape "
                    f"{tuple(param.shape)}) that the NF4 tensor (2-D only) cannot hold; train this model with "
                    "LoRA on a bf16 base (load_in_4bit=false)"
                )
    names = {id(m): n for n, m in model.named_modules()}
    for layer in layers:
        for module in layer.modules():
            if not isinstance(module, torch.nn.Linear) or id(module.weight) in quantised:
                continue
            name = names[id(module)]
            if any(name == s or name.endswith("." + s) for s in skip):
                continue
            weight = module.weight
            if weight.device.type == "meta" and not meta_ok:
                raise QuantizationError(
                    f"load_in_4bit=true: {name}.weight is on the meta device (rank-0-only loading, "
                    "fsdp_cpu_ram_efficient_loading=true); turn that off: each rank quantises the base itself"
                )
            rows, numel = weight.shape[0], weight.numel()
            block = scaler_block_for(numel, rows, shards)
            if block is None:
                raise QuantizationError(
                    f"load_in_4bit=true: {name}.weight {tuple(weight.shape)} cannot be split evenly into NF4 shards "
                    f"over {shards} ranks (its {rows} rows, {numel // 2} code bytes and {numel // NF4_BLOCK_SIZE} "
                    f"scales must each divide by {shards}, and the scales by 64-element blocks); use a world size "
                    "that divides them, or load_in_4bit=false"
                )
            if block != NF4_SCALER_BLOCK_SIZE:
                report.small_scaler_blocks[name] = block
            source = weight.detach()
            # On meta (the memory plan's model) there are no values: one NF4 tensor per shape (to_nf4 costs ~30 ms).
            if weight.device.type == "meta":
                key = (tuple(weight.shape), source.dtype, block)
                if key not in meta_templates:
                    meta_templates[key] = to_nf4(source.contiguous(), NF4_BLOCK_SIZE, block)
                nf4: torch.Tensor = meta_templates[key].detach()
            else:
                nf4 = to_nf4(source.contiguous(), NF4_BLOCK_SIZE, block)
            module.weight = torch.nn.Parameter(nf4, requires_grad=False)
            quantised.add(id(module.weight))
            report.weights += 1
            report.source_bytes += numel * source.element_size()
            report.nf4_bytes += nf4_bytes(nf4)
    report.kept_bytes = sum(
        p.numel() * p.element_size() for p in model.parameters() if id(p) not in quantised
    )
    if not report.weights:
        raise QuantizationError(
            f"load_in_4bit=true: no nn.Linear inside the decoder layers of {type(model).__name__}"
        )
    if report.small_scaler_blocks:
        logger.info(
            "NF4: %d weights quantise their scales per %s instead of %d, for an even split over %d ranks",
            len(report.small_scaler_blocks),
            sorted(set(report.small_scaler_blocks.values())),
            NF4_SCALER_BLOCK_SIZE,
            shards,
        )
    return report


def local_nf4_bytes(model: torch.nn.Module) -> int:
    """Bytes of the NF4 weights this rank holds (after sharding: its shards; before: everything)."""
    return sum(nf4_bytes(p) for p in model.parameters() if is_nf4(p))
