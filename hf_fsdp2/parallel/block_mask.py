"""The documents and sliding window of a context-parallel attention as a flex attention ``BlockMask``, instead of a
dense ``[rows, 1, L, L]`` mask in every layer (:func:`hf_fsdp2.parallel.all_to_all.cp_attention`).

A query may see a key when ``k <= q``, both are in the same document of the row (documents from the whole row's
``position_ids``: a position that does not follow its predecessor starts one, as transformers detects them), and
``q - k < window`` when the layer has one. Over tiles of :data:`FLEX_BLOCK` x :data:`FLEX_BLOCK` positions that
rule is decided per tile from the first and last position and document of each (documents are numbered in order, so
a tile's are a contiguous range): a tile is *empty* (skipped), *full* (every pair allowed: the kernel skips the mask)
or *partial* (the kernel evaluates the rule per element, from the ``[rows, L]`` document ids). What is kept is
``O(rows x (L / 128)^2)`` int32 tile lists and the document ids, not ``O(rows x L^2)``: at 32k tokens a row's dense
bool mask is 1 GiB per layer, its block mask 1.3 MiB (:func:`block_mask_bytes`).

torch 2.13's flex attention trains on CUDA (and XPU/HPU): its compiled kernel never materialises the scores. On CPU
(and MPS) it has no backward (NotImplementedError), so there the dense mask remains (:func:`flex_trains_on`).
"""

from __future__ import annotations

from typing import Any

import torch

# flex attention's default tile (torch's _DEFAULT_SPARSE_BLOCK_SIZE): the kernel's Q and KV block sizes.
FLEX_BLOCK = 128
# Device types whose flex attention has a backward in torch 2.13 (flex_attention's _validate_device refuses
# requires_grad inputs on cpu and mps).
FLEX_TRAINING_DEVICES = ("cuda", "xpu", "hpu")


def flex_trains_on(device_type: str) -> bool:
    """Whether flex attention can train on ``device_type`` (a backward exists there)."""
    return device_type in FLEX_TRAINING_DEVICES


def document_starts(positions: torch.Tensor) -> torch.Tensor:
    """``[batch, length]`` booleans, True where a document starts in whole-row ``positions``: at every row's first
    position and wherever a position does not follow its predecessor (as transformers detects packed documents)."""
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    return starts


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """``[rows, L]`` document numbers (1, 2, ... per row) from whole-row ``positions``."""
    return document_starts(positions).long().cumsum(dim=1)


def _tile_lists(allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[rows, nq, nk]`` booleans -> the count per query tile ``[rows, 1, nq]`` and the key tiles, those marked
    first, ``[rows, 1, nq, nk]`` (int32, as flex attention takes them)."""
    count = allowed.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort((~allowed).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count[:, None], order[:, None]


def build_block_mask(
    documents: torch.Tensor | None, length: int, window: int | None, rows: int, device: torch.device
) -> Any:
    """The ``BlockMask`` of causal attention over ``length`` positions, within documents (``documents``:
    :func:`document_ids`, ``[rows, length]``; None: one document per row) and a sliding ``window`` (None: none).

    Every rank of a context-parallel group builds the same one (from the whole row's positions), with tensor ops
    only: nothing is read back to the host.
    """
    from torch.nn.attention.flex_attention import BlockMask

    tiles = -(-length // FLEX_BLOCK)
    first = torch.arange(tiles, device=device) * FLEX_BLOCK
    last = (first + FLEX_BLOCK - 1).clamp(max=length - 1)
    q_first, q_last = first[:, None], last[:, None]  # [nq, 1]
    k_first, k_last = first[None, :], last[None, :]  # [1, nk]
    # Causal: some key of the tile at or before some query; every key before every query.
    some = (k_first <= q_last)[None].expand(rows, tiles, tiles)
    every = (k_last <= q_first)[None].expand(rows, tiles, tiles)
    if window is not None:
        some = some & (q_first - k_last < window)[None]
        every = every & (q_last - k_first < window)[None]
    if documents is not None:
        doc_first, doc_last = (
            documents[:, first],
            documents[:, last],
        )  # [rows, tiles]: each tile's document range
        q_lo, q_hi = doc_first[:, :, None], doc_last[:, :, None]
        k_lo, k_hi = doc_first[:, None, :], doc_last[:, None, :]
        some = some & (k_lo <= q_hi) & (q_lo <= k_hi)
        every = every & (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)
    partial = some & ~every
    kv_count, kv_index = _tile_lists(partial)
    full_count, full_index = _tile_lists(every)

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        allowed = k <= q
        if window is not None:
            allowed = allowed & (q - k < window)
        if documents is not None:
            allowed = allowed & (documents[b, q] == documents[b, k])
        return allowed

    return BlockMask.from_kv_blocks(
        kv_count,
        kv_index,
        full_count,
        full_index,
        BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=mask_mod,
        seq_lengths=(length, length),
    )


def block_mask_bytes(rows: int, length: int, documents: bool) -> int:
    """What a :func:`build_block_mask` holds: four int32 tile lists ``[rows, 1, nq, nk]`` (KV-major, partial and
    full, and their Q-major transposes for the backward) with their four counts ``[rows, 1, nq]``, and the
    ``[rows, L]`` int64 document ids the per-element rule reads (when there are documents)."""
    tiles = -(-length // FLEX_BLOCK)
    return 4 * 4 * rows * tiles * (tiles + 1) + (8 * rows * length if documents else 0)


def dense_mask_bytes(rows: int, length: int, itemsize: int) -> int:
    """The dense ``[rows, 1, L, L]`` mask's bytes (bool for sdpa: ``itemsize`` 1; the compute dtype for eager)."""
    return rows * length * length * itemsize


_COMPILED: dict[str, Any] = {}


def flex(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block_mask: Any,
    *,
    scale: float | None,
    softcap: float | None,
) -> torch.Tensor:
    """Flex attention of ``[batch, heads, L, d]`` inputs under ``block_mask`` (grouped KV heads as they are; the
    logits soft-capped when ``softcap``), returned as the model's kernels return it: ``[batch, L, heads, d]``.

    Compiled (once per process) outside a compiled region, where flex attention's fused kernel is what keeps the
    scores from being materialised; inside one (regional compile) the layer's graph compiles it.
    """
    from torch.nn.attention.flex_attention import flex_attention

    score_mod = None
    if softcap:

        def score_mod(score: torch.Tensor, b: Any, h: Any, q: Any, k: Any) -> torch.Tensor:
            return torch.tanh(score / softcap) * softcap

    kernel = flex_attention
    if query.device.type != "cpu" and not torch.compiler.is_compiling():
        kernel = _COMPILED.setdefault("flex", torch.compile(flex_attention))
    heads = query.shape[1]
    if key.shape[1] != heads and heads & (heads - 1):
        # flex's grouped-query kernel wants a power-of-two head count (tensor parallel leaves heads / tp): the KV
        # heads repeated instead, as transformers' flex path does.
        key = key.repeat_interleave(heads // key.shape[1], dim=1)
        value = value.repeat_interleave(heads // value.shape[1], dim=1)
    grouped = key.shape[1] != heads
    out = kernel(
        query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=grouped
    )
    return out.transpose(1, 2).contiguous()
