"""Context parallel, all-to-all (Ulysses-style): each sequence split over the ``cp`` ranks of a group.

Each rank of a context-parallel group holds ``1/cp`` of every sequence of the micro-batch (contiguous positions:
rank ``i`` the ``i``-th part), so activations, norms, MLPs and the loss cost ``1/cp`` per rank. Attention needs the
whole sequence: around it, one all-to-all hands each rank every position of ``heads/cp`` heads (heads scattered,
sequence gathered), the run's own attention kernel runs on them over the whole sequence, and a second all-to-all
gives each rank its positions back with every head. torch's autograd all-to-all
(``all_to_all_single_autograd``) carries the gradients the same way back; gloo has it, so this backend runs on CPU.

Masks: the kernel sees whole sequences, so the mask is built here from the whole sequence's ``position_ids``
(handed to every layer as the keyword :data:`POSITIONS_KEY`): causal, no attention across the documents of a packed
or padding-free row (a position that does not follow its predecessor starts a document, as transformers detects
them), and the layer's sliding window when it has one. Under sdpa and eager it is flex attention's block mask, run by
flex attention's kernel (:mod:`hf_fsdp2.parallel.block_mask`: tile lists, no ``[rows, 1, S, S]`` tensor), where flex
attention trains (CUDA); elsewhere (CPU, attention dropout or sinks) a dense mask, refused over a size
(:func:`check_dense_mask`). Right padding needs no mask: causal attention never lets a
real token see the padding after it. A flash kernel takes no mask: it is handed the documents' boundaries over the
rows laid end to end (``cu_seq_lens_q/k``, ``max_length_q/k``, :func:`varlen_boundaries`), which transformers' flash
path takes at any number of rows, where from ``position_ids`` it finds documents in a one-row batch only.

The loss: each rank scores its own positions, including the last one, whose next token lies on the next rank: its
labels carry one more column than its input (:func:`shard_sequence`), which the losses of :mod:`hf_fsdp2.train.loss`
read as "the targets of every position". Token counts are then each rank's own; their sum over the ranks is the
batch's, so the step's loss (sum over every target token / their count) and its gradient are the flat run's.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from hf_fsdp2.config.plans import split_heads
from hf_fsdp2.labels import IGNORE_INDEX
from hf_fsdp2.parallel.block_mask import (
    block_mask_bytes,
    build_block_mask,
    dense_mask_bytes,
    document_ids,
    document_starts,
    flex,
    flex_trains_on,
)

ATTENTION_NAME = "hf_fsdp2_cp_all_to_all"
POSITIONS_KEY = "hf_fsdp2_cp_positions"
RING_ATTENTION_NAME = "hf_fsdp2_cp_ring"  # the ring backend's interface (hf_fsdp2.parallel.ring)
# The run's own kernels that the all-to-all wraps (flex needs its block mask built for the whole sequence).
INNER_KERNELS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")


# A dense mask of one layer over this is refused, over the other warned once (see check_dense_mask).
DENSE_MASK_LIMIT_BYTES = 2**30
DENSE_MASK_WARN_BYTES = 2**26
_WARNED: list[int] = []
logger = logging.getLogger("hf_fsdp2")


class ContextParallelError(ValueError):
    """A context-parallel setting the model or batch cannot run; the message says why and what to do."""


def check_right_padded(mask: torch.Tensor | None) -> None:
    """Refuse a left-padded batch: under context parallel its padding would sit before real tokens of another rank.

    Raises:
        ContextParallelError: ``mask`` has padding before tokens.
    """
    if mask is not None and bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise ContextParallelError(
            "context parallel needs right-padded batches (padding after the tokens); this batch has padding before "
            "tokens: set the tokenizer's padding_side to 'right'"
        )


def shard_sequence(
    batch: dict[str, torch.Tensor], cp: int, index: int, *, check_padding: bool = True
) -> dict[str, torch.Tensor]:
    """Context-parallel rank ``index``'s part of a collated micro-batch (host tensors, every rank of the group
    holding the same batch).

    The sequence is padded to a multiple of ``cp`` (padding: no target, a document of its own), cut into ``cp``
    contiguous parts; this rank keeps its part of ``input_ids`` and ``position_ids`` (the whole row's positions
    when the batch has none: transformers numbers a padded row 0..n-1), and its labels with one more column: the
    label of the position after its last one (-100 on the last rank). The whole row's ``position_ids`` of a packed
    or padding-free batch ride along as :data:`POSITIONS_KEY` for the attention mask.

    Tensors stay where they are (device inputs, host labels). ``check_padding=False`` skips the right-padding check
    (a read of the mask: a host sync for a device mask) where the collator is known to pad on the right.

    Raises:
        ContextParallelError: a left-padded batch (its padding would sit before real tokens of another rank).
    """
    if check_padding:
        check_right_padded(batch.get("attention_mask"))
    padded = pad_to_multiple(batch, cp)
    ids, labels, positions = padded["input_ids"], padded["labels"], padded.get("position_ids")
    rows, full = ids.shape
    part = full // cp
    start, end = index * part, (index + 1) * part
    whole = positions if positions is not None else torch.arange(full, device=ids.device).expand(rows, full)
    out = {
        "input_ids": ids[:, start:end].contiguous(),
        "labels": F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, start : end + 1].contiguous(),
        "position_ids": whole[:, start:end].contiguous(),
    }
    if positions is not None:
        out[POSITIONS_KEY] = positions.contiguous()
    return out


def pad_to_multiple(batch: dict[str, torch.Tensor], multiple: int) -> dict[str, torch.Tensor]:
    """A collated micro-batch padded on the right to a length that is a multiple of ``multiple`` (itself when it is
    one): ``input_ids`` with 0, ``labels`` with -100 (no target), ``attention_mask`` with 0, ``position_ids`` counting
    from 0 (the padding a document of its own, attending to itself only). Causal attention never lets a real token see
    padding after it, so the real tokens' values are unchanged."""
    ids = batch["input_ids"]
    rows, width = ids.shape
    pad = (-width) % multiple
    if not pad:
        return batch
    out = dict(batch)
    out["input_ids"] = F.pad(ids, (0, pad), value=0)
    out["labels"] = F.pad(batch["labels"], (0, pad), value=IGNORE_INDEX)
    if batch.get("attention_mask") is not None:
        out["attention_mask"] = F.pad(batch["attention_mask"], (0, pad), value=0)
    positions = batch.get("position_ids")
    if positions is not None:
        out["position_ids"] = torch.cat(
            [positions, torch.arange(pad, device=positions.device).expand(rows, pad)], dim=1
        )
    return out


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    out = all_to_all_single_autograd(x.contiguous(), None, None, group)
    return wait_tensor(out)


def gather_sequence(x: torch.Tensor, group: Any, cp: int) -> torch.Tensor:
    """``[batch, heads, part, dim]`` on each rank -> ``[batch, heads / cp, part x cp, dim]``: this rank's heads
    over the whole sequence (the parts in rank order)."""
    b, h, s, d = x.shape
    chunks = x.reshape(b, cp, h // cp, s, d).transpose(0, 1)  # [cp, b, h/cp, s, d]: chunk j goes to rank j
    got = _all_to_all(chunks, group)  # [cp, b, h/cp, s, d]: rank i's part of my heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def scatter_sequence(x: torch.Tensor, group: Any, cp: int) -> torch.Tensor:
    """The inverse for the kernel's output: ``[batch, part x cp, heads / cp, dim]`` -> ``[batch, part, heads,
    dim]`` (this rank's positions, every head)."""
    b, full, h, d = x.shape
    s = full // cp
    chunks = x.reshape(b, cp, s, h, d).transpose(0, 1)  # [cp, b, s, h, d]: part j goes back to rank j
    got = _all_to_all(chunks, group)  # [cp, b, s, h, d]: rank i's heads of my part
    return got.permute(1, 2, 0, 3, 4).reshape(b, s, cp * h, d)


def allowed_pairs(
    positions: torch.Tensor | None, length: int, window: int | None, device: torch.device
) -> torch.Tensor:
    """``[batch or 1, 1, length, length]`` booleans, True where query q may attend to key k: k <= q, the same
    document (from whole-row ``positions``; None: one document), and q - k < ``window`` when given."""
    q = torch.arange(length, device=device)
    allowed = (q[None, :] <= q[:, None])[None, None]
    if window is not None:
        allowed = allowed & ((q[:, None] - q[None, :]) < window)[None, None]
    if positions is not None:
        doc = document_ids(positions)
        allowed = allowed & (doc[:, None, :, None] == doc[:, None, None, :])
    return allowed


def varlen_boundaries(positions: torch.Tensor) -> dict[str, Any]:
    """The documents of whole-row ``positions`` (``[batch, length]``) as transformers' flash path takes them at any
    number of rows: ``cu_seq_lens_q/k``, where each document starts over the rows laid end to end (int32, ``[documents
    + 1]``, the last entry ``batch x length``), and ``max_length_q/k``, the longest document (an int: flash-attn's
    varlen kernels take it as one). No document spans two rows. Reads the device twice (the count and the longest),
    as transformers' own detection from position_ids does in every layer."""
    first = document_starts(positions).reshape(-1).nonzero().reshape(-1)
    cu = torch.cat([first, first.new_tensor([positions.numel()])]).to(torch.int32)
    longest = int(cu.diff().max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


class _InnerConfig:
    """The model's config as the wrapped kernel reads it: naming that kernel, not this module's interface
    (transformers' flash path loads its kernel functions by ``config._attn_implementation``)."""

    def __init__(self, config: Any, name: str) -> None:
        self._config, self._attn_implementation = config, name

    def __getattr__(self, key: str) -> Any:
        return getattr(self._config, key)


class _KernelView:
    """The attention module as the wrapped kernel sees it: its KV groups per query head after a KV repeat
    (``groups``), and a config naming a flash kernel (``flash``); None: the module's own."""

    def __init__(self, module: torch.nn.Module, groups: int | None, flash: str | None) -> None:
        self._module = module
        if groups is not None:
            self.num_key_value_groups = groups
        if flash is not None:
            self.config = _InnerConfig(getattr(module, "config"), flash)  # noqa: B009  # a transformers module's

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _inner(module: torch.nn.Module, name: str) -> Any:
    if name == "eager":  # each modeling file has its own (Gemma2's soft-caps), beside the attention class
        return sys.modules[type(module).__module__].eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[name]


def cp_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention interface the model runs under context parallel (registered as :data:`ATTENTION_NAME`):
    all-to-all to whole sequences, the run's kernel with the whole sequence's mask (a flash kernel: its documents'
    boundaries, :func:`varlen_boundaries`), all-to-all back.

    ``query``: ``[batch, heads, part, dim]`` (this rank's positions); returns ``[batch, part, heads, dim]``.
    """
    group, split, name = getattr(module, "_hf_fsdp2_cp")  # noqa: B009  # set by enable_context_parallel
    positions = kwargs.pop(POSITIONS_KEY, None)
    kwargs.pop("is_causal", None)  # causality is this function's mask
    kernel = _inner(module, name)  # the module's own (its modeling file's eager), before any proxy
    groups, flash = None, name if name.startswith("flash") else None
    if split.kv_repeat > 1:
        key = key.repeat_interleave(split.kv_repeat, dim=1)
        value = value.repeat_interleave(split.kv_repeat, dim=1)
        groups = split.heads // (split.kv_heads * split.kv_repeat)
    view = _KernelView(module, groups, flash) if groups is not None or flash else module
    q, k, v = (gather_sequence(t, group, split.cp) for t in (query, key, value))
    window = kwargs.get("sliding_window")
    length = q.shape[2]
    mask: torch.Tensor | None = None
    if flash:
        # The layer's position_ids are this rank's part, not the whole sequence the kernel runs on. Rows of several
        # documents get their boundaries explicitly: from position_ids transformers' flash path separates documents
        # only in a one-row batch. Without positions each row is one sequence, padded on the right: causal suffices.
        kwargs.pop("position_ids", None)
        if positions is not None:
            kwargs.update(varlen_boundaries(positions.to(q.device)))
    elif name == "eager" or positions is not None or window is not None:
        why_dense = dense_mask_reason(q.device.type, kwargs)
        if not why_dense:
            # Documents and windows as flex attention's block mask: tile lists, not [rows, 1, S, S] per layer.
            documents = document_ids(positions.to(q.device)) if positions is not None else None
            rows = documents.shape[0] if documents is not None else 1
            mask = build_block_mask(documents, length, window, rows, q.device)
            out = flex(q, k, v, mask, scale=kwargs.get("scaling"), softcap=kwargs.get("softcap"))
            return scatter_sequence(out, group, split.cp), None
        allowed = allowed_pairs(positions, length, window, q.device)
        check_dense_mask(allowed.shape[0], length, q.element_size() if name == "eager" else 1, why_dense)
        if name == "eager":
            mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
            mask = mask.masked_fill(~allowed, torch.finfo(q.dtype).min)
        else:
            mask = allowed
    out, _ = kernel(view, q, k, v, mask, **kwargs)
    return scatter_sequence(out, group, split.cp), None


def dense_mask_reason(device_type: str, kwargs: dict[str, Any]) -> str:
    """Why a layer's documents or window need the dense ``[rows, 1, S, S]`` mask rather than flex attention's block
    mask ('' when they do not): a device where flex attention has no backward, attention dropout or attention sinks
    (flex attention has neither)."""
    if not flex_trains_on(device_type):
        return f"flex attention has no backward on {device_type} (torch 2.13)"
    if kwargs.get("dropout"):
        return f"attention dropout {kwargs['dropout']:g} (flex attention has none)"
    if kwargs.get("s_aux") is not None:
        return "attention sinks (flex attention has none)"
    return ""


def check_dense_mask(rows: int, length: int, itemsize: int, why: str) -> None:
    """Refuse a dense ``[rows, 1, S, S]`` mask over :data:`DENSE_MASK_LIMIT_BYTES` in one layer (built per layer and
    kept for backward); warn once per process over :data:`DENSE_MASK_WARN_BYTES`.

    Raises:
        ContextParallelError: the mask's bytes, why it is dense, and the fix.
    """
    size = dense_mask_bytes(rows, length, itemsize)
    if size > DENSE_MASK_LIMIT_BYTES:
        raise ContextParallelError(
            f"context parallel: a dense [{rows}, 1, {length}, {length}] attention mask of {size / 2**30:.1f} GiB per "
            f"layer (kept for backward) for this micro-batch's documents or sliding window, because {why}; the limit "
            f"is {DENSE_MASK_LIMIT_BYTES / 2**30:.0f} GiB: train on CUDA (flex attention's block mask), use "
            "attn_implementation=flash_attention_2 (the documents' boundaries, no mask), set attention_dropout=0, or "
            "shorten the rows (max_length, or fewer rows per micro-batch)"
        )
    if size > DENSE_MASK_WARN_BYTES and not _WARNED:
        _WARNED.append(size)
        logger.warning(
            "context parallel: a dense [%d, 1, %d, %d] attention mask of %.0f MiB per layer (kept for backward), "
            "because %s; on CUDA flex attention's block mask holds %.1f MiB instead",
            rows,
            length,
            length,
            size / 2**20,
            why,
            block_mask_bytes(rows, length, documents=True) / 2**20,
        )


def register_attention() -> None:
    """Make :data:`ATTENTION_NAME` an attention implementation transformers models can run (idempotent)."""
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, cp_attention)


def enable_context_parallel(model: torch.nn.Module, group: Any, cp: int, tp: int = 1) -> str:
    """Run ``model``'s attention through :func:`cp_attention` over ``group`` (``cp`` ranks), wrapping the kernel
    the model was loaded with (``tp``: the tensor-parallel size, whose ranks hold heads / tp each). Call before
    sharding and compiling. Returns the line the run logs.

    Raises:
        ContextParallelError: a kernel the all-to-all cannot wrap, or heads that do not split.
    """
    config: Any = getattr(model, "config")  # noqa: B009  # a transformers model's
    name = getattr(config, "_attn_implementation", None) or "eager"
    if name not in INNER_KERNELS:
        raise ContextParallelError(
            f"context parallel (all-to-all) wraps the attention kernels {', '.join(INNER_KERNELS)}; the model runs "
            f"{name!r}: set attn_implementation to sdpa (or flash_attention_2 on GPU)"
        )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    # Under tensor parallel each rank's attention holds heads / tp of them: those are what the all-to-all scatters.
    kv = getattr(text, "num_key_value_heads", None)
    split = split_heads(int(text.num_attention_heads) // tp, kv // tp if kv else None, cp)
    register_attention()
    marked = 0
    for module in model.modules():
        if hasattr(module, "num_key_value_groups") or type(module).__name__.endswith("Attention"):
            setattr(module, "_hf_fsdp2_cp", (group, split, name))  # noqa: B010  # read by cp_attention
            marked += 1
    if not marked:
        raise ContextParallelError(f"{type(model).__name__} has no attention module the all-to-all can wrap")
    for sub in {id(c): c for c in (config, text)}.values():
        sub._attn_implementation = ATTENTION_NAME
    return (
        f"context parallel: all-to-all over {cp} ranks around the {name} kernel ({marked} attention modules): "
        f"{split.describe()}; each rank holds 1/{cp} of every sequence"
    )


@contextlib.contextmanager
def whole_sequences(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model``'s attention with its own kernel inside the block (no all-to-all): for forwards where every rank
    holds the same whole sequence (greedy samples at eval), which the all-to-all would read as ``cp`` parts of one.
    A no-op for a model without context parallel."""
    inner = next((getattr(m, "_hf_fsdp2_cp")[2] for m in model.modules() if hasattr(m, "_hf_fsdp2_cp")), None)  # noqa: B009
    configs: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "_attn_implementation", None) in (ATTENTION_NAME, RING_ATTENTION_NAME):
            configs[id(config)] = config
    names = {key: config._attn_implementation for key, config in configs.items()}
    for config in configs.values():
        config._attn_implementation = inner
    try:
        yield
    finally:
        for key, config in configs.items():
            config._attn_implementation = names[key]
