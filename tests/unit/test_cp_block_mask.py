"""Context parallel's block mask (hf_fsdp2/parallel/block_mask.py) against the dense mask it replaces: every tile it
marks full is allowed everywhere, every tile it leaves out is allowed nowhere, over several tiles, with documents that
cross tile edges and windows narrower and wider than a tile; flex attention under it gives sdpa's output under the
dense mask; the bytes it holds are the formula's; when the dense mask remains (CPU, dropout, sinks) it is refused
over a size, with the reason. The 4-rank losses and gradients: tests/distributed/test_context_parallel.py."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from hf_fsdp2.parallel import all_to_all
from hf_fsdp2.parallel.all_to_all import (
    ContextParallelError,
    allowed_pairs,
    check_dense_mask,
    dense_mask_reason,
)
from hf_fsdp2.parallel.block_mask import (
    FLEX_BLOCK,
    block_mask_bytes,
    build_block_mask,
    document_ids,
    flex,
)

LENGTH = 300  # three 128-position tiles, the last one short


def _positions(lengths: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])


# (documents per row or None, window or None)
CASES = [
    ([[100, 150, 50], [10, 200, 90]], None),  # documents across tile edges
    ([[100, 150, 50], [10, 200, 90]], 37),  # and a window narrower than a tile
    (None, 200),  # one document per row, a window wider than a tile
    (None, None),  # plain causal
    ([[300], [1, 299]], 129),
]


@pytest.mark.parametrize(("lengths", "window"), CASES)
def test_tiles_marked_full_or_left_out_agree_with_the_dense_mask(
    lengths: list | None, window: int | None
) -> None:
    positions = _positions(lengths) if lengths else None
    rows = 2 if lengths else 1
    documents = document_ids(positions) if positions is not None else None
    mask = build_block_mask(documents, LENGTH, window, rows, torch.device("cpu"))
    dense = allowed_pairs(positions, LENGTH, window, torch.device("cpu"))[:, 0].expand(rows, -1, -1)
    kv_count, kv_index, full_count, full_index = (t[:, 0] for t in mask.as_tuple()[2:6])
    tiles = -(-LENGTH // FLEX_BLOCK)
    for b in range(rows):
        for qi in range(tiles):
            partial = set(kv_index[b, qi, : kv_count[b, qi]].tolist())
            full = set(full_index[b, qi, : full_count[b, qi]].tolist())
            assert not partial & full
            for kj in range(tiles):
                tile = dense[
                    b, qi * FLEX_BLOCK : (qi + 1) * FLEX_BLOCK, kj * FLEX_BLOCK : (kj + 1) * FLEX_BLOCK
                ]
                if kj in full:
                    assert bool(tile.all()), (b, qi, kj)
                elif kj not in partial:
                    assert not bool(tile.any()), (b, qi, kj)


@pytest.mark.parametrize(("lengths", "window"), CASES[1:3])
def test_flex_attention_under_the_block_mask_is_sdpa_under_the_dense_mask(
    lengths: list | None, window: int | None
) -> None:
    gen = torch.Generator().manual_seed(0)
    positions = _positions(lengths) if lengths else None
    rows = 2 if lengths else 1
    q = torch.randn(rows, 4, LENGTH, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(rows, 2, LENGTH, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    documents = document_ids(positions) if positions is not None else None
    mask = build_block_mask(documents, LENGTH, window, rows, torch.device("cpu"))
    got = flex(q, k, v, mask, scale=None, softcap=None)  # forward only: flex has no backward on CPU
    allowed = allowed_pairs(positions, LENGTH, window, torch.device("cpu"))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_the_bytes_it_holds_are_the_formulas_and_far_below_the_dense_masks() -> None:
    positions = _positions([[100, 150, 50], [10, 200, 90]])
    documents = document_ids(positions)
    mask = build_block_mask(documents, LENGTH, 37, 2, torch.device("cpu"))
    held = sum(t.nbytes for t in mask.as_tuple() if isinstance(t, torch.Tensor)) + documents.nbytes
    assert held == block_mask_bytes(2, LENGTH, documents=True) == 4 * 4 * 2 * 3 * 4 + 8 * 2 * 300
    # A 32k-token row: 1 GiB of bool mask per layer, 1.3 MiB of block mask (256 tiles of 128).
    assert block_mask_bytes(1, 32768, documents=True) == 16 * 256 * 257 + 8 * 32768  # 1.27 MiB
    assert 32768 * 32768 == 2**30


def test_the_dense_mask_remains_where_flex_cannot_train_and_is_refused_over_a_gib(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert dense_mask_reason("cuda", {}) == ""
    assert "no backward on cpu" in dense_mask_reason("cpu", {})
    assert "attention dropout 0.1" in dense_mask_reason("cuda", {"dropout": 0.1})
    assert "sinks" in dense_mask_reason("cuda", {"s_aux": torch.zeros(2)})
    with pytest.raises(
        ContextParallelError, match=r"dense \[1, 1, 40000, 40000\] .* 1\.5 GiB per layer .*because x"
    ):
        check_dense_mask(1, 40000, 1, "x")
    monkeypatch.setattr(all_to_all, "_WARNED", [])
    with caplog.at_level(logging.WARNING, logger="hf_fsdp2"):
        check_dense_mask(1, 16384, 1, "y")  # 256 MiB: warned once
        check_dense_mask(1, 16384, 1, "y")
    warned = [r.message for r in caplog.records if "dense [1, 1, 16384, 16384]" in r.message]
    assert len(warned) == 1 and "256 MiB per layer" in warned[0] and "because y" in warned[0]
