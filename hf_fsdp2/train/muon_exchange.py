"""Muon's exchange of row blocks: which rank orthogonalises which matrix (:func:`owner_rounds`), rounds grouped in
buckets (:func:`muon_buckets`), and each bucket's two asynchronous all-to-alls (:class:`Exchange`): every rank's row
blocks to the owners, the orthogonalised rows back (:class:`hf_fsdp2.train.muon.MuonAdamW`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def _row_blocks(rows: int, world: int) -> list[int]:
    """Rows of each rank's block of a ``Shard(0)`` DTensor: ``torch.chunk``'s sizes, empty blocks at the end (how
    DTensor and FSDP2 split a dimension that the world does not divide)."""
    sizes = [len(c) for c in torch.arange(rows).chunk(world)]
    return sizes + [0] * (world - len(sizes))


def owner_rounds(shapes: list[tuple[int, int]], world: int) -> list[list[int | None]]:
    """Which matrix each rank orthogonalises in each round: largest first, each to the rank with the least
    Newton-Schulz work so far (``min(m, n)^2 * max(m, n)``, lowest rank on a tie).

    Returns:
        Rounds; round ``k`` is, per rank, the index (into ``shapes``) of its ``k``-th matrix or None.
    """
    cost = [min(s) ** 2 * max(s) for s in shapes]
    order = sorted(range(len(shapes)), key=lambda i: (-cost[i], i))
    load, owned = [0] * world, [[] for _ in range(world)]  # type: list[int], list[list[int]]
    for i in order:
        rank = min(range(world), key=lambda r: (load[r], r))
        load[rank] += cost[i]
        owned[rank].append(i)
    depth = max((len(o) for o in owned), default=0)
    return [[o[k] if k < len(o) else None for o in owned] for k in range(depth)]


# The whole matrices (bf16) one rank gathers per bucket of rounds: two buckets are in flight at once (one gathering,
# one orthogonalised or scattering back). At Llama-3-8B's shapes on 8 ranks, 28 rounds go in 8 buckets (the MLP's
# 112 MiB matrices two rounds a bucket, q/o and k/v eight): 16 all-to-alls per step instead of 56.
MUON_BUCKET_BYTES = 256 * 2**20


def muon_buckets(
    rounds: list[list[int | None]], shapes: list[tuple[int, int]], world: int, cap: int
) -> list[list[int]]:
    """Consecutive rounds (:func:`owner_rounds`) grouped into buckets, each as many rounds as keep every rank's
    gathered whole matrices (bf16) within ``cap`` bytes (at least one round). Two all-to-alls per bucket."""
    buckets: list[list[int]] = []
    current: list[int] = []
    load = [0] * world
    for k, row in enumerate(rounds):
        add = [0 if i is None else 2 * shapes[i][0] * shapes[i][1] for i in row]
        if current and max(a + b for a, b in zip(load, add, strict=True)) > cap:
            buckets.append(current)
            current, load = [], [0] * world
        current.append(k)
        load = [a + b for a, b in zip(load, add, strict=True)]
    if current:
        buckets.append(current)
    return buckets


@dataclass(kw_only=True)
class Flight:
    """One bucket's all-to-all in flight: its work handle, the rounds, this rank's matrices in them, the splits and
    the buffer it fills."""

    work: Any
    rounds: list[list[int | None]]
    mine: list[int]
    in_split: list[int]
    out_split: list[int]
    buffer: torch.Tensor


@dataclass(kw_only=True)
class Exchange:
    """Row blocks to owners and back, a bucket of rounds per all-to-all (see ``MuonAdamW._orthogonalise``)."""

    updates: list[torch.Tensor]
    shapes: list[tuple[int, int]]
    blocks: list[list[int]]
    me: int
    world: int
    group: Any
    sent: int = 0

    def _size(self, i: int, rank: int) -> int:
        return self.blocks[i][rank] * self.shapes[i][1]

    def gather(self, rounds: list[list[int | None]]) -> Flight:
        """Send every rank, for each round of the bucket, this rank's row block of the matrix it owns there;
        receive from every rank its row blocks of the matrices this rank owns (async)."""
        dtype, device = torch.bfloat16, self.updates[0].device
        mine = [i for row in rounds if (i := row[self.me]) is not None]
        by_dest = [[i for row in rounds if (i := row[j]) is not None] for j in range(self.world)]
        in_split = [sum(self._size(i, self.me) for i in owned) for owned in by_dest]
        out_split = [sum(self._size(i, r) for i in mine) for r in range(self.world)]
        pieces = [self.updates[i].to(dtype).reshape(-1) for owned in by_dest for i in owned]
        send = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=device)
        received = torch.empty(sum(out_split), dtype=dtype, device=device)
        work = dist.all_to_all_single(received, send, out_split, in_split, group=self.group, async_op=True)
        self.sent += (send.numel() - in_split[self.me]) * send.element_size()
        return Flight(
            work=work, rounds=rounds, mine=mine, in_split=in_split, out_split=out_split, buffer=received
        )

    def wholes(self, flight: Flight) -> list[torch.Tensor]:
        """This rank's whole matrices of a gathered bucket, in round order."""
        per_source = flight.buffer.split(flight.out_split)
        parts = [chunk.split([self._size(i, r) for i in flight.mine]) for r, chunk in enumerate(per_source)]
        return [
            torch.cat([parts[r][n].view(self.blocks[i][r], self.shapes[i][1]) for r in range(self.world)])
            for n, i in enumerate(flight.mine)
        ]

    def scatter(self, gathered: Flight, orthogonal: list[torch.Tensor]) -> Flight:
        """Send each rank its rows of this rank's orthogonalised matrices; receive this rank's rows of every
        matrix of the bucket from their owners (async)."""
        dtype = torch.bfloat16
        pieces = []
        for r in range(self.world):
            for i, whole in zip(gathered.mine, orthogonal, strict=True):
                start = sum(self.blocks[i][:r])
                pieces.append(whole[start : start + self.blocks[i][r]].reshape(-1).to(dtype))
        back = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=self.updates[0].device)
        received = torch.empty(sum(gathered.in_split), dtype=dtype, device=back.device)
        work = dist.all_to_all_single(
            received, back, gathered.in_split, gathered.out_split, group=self.group, async_op=True
        )
        self.sent += (back.numel() - gathered.out_split[self.me]) * back.element_size()
        return Flight(
            work=work,
            rounds=gathered.rounds,
            mine=gathered.mine,
            in_split=gathered.in_split,
            out_split=gathered.out_split,
            buffer=received,
        )

    def unpack(self, flight: Flight, out: list[torch.Tensor | None]) -> None:
        """This rank's orthogonalised row block of every matrix of a scattered bucket, into ``out``."""
        for j, chunk in enumerate(flight.buffer.split(flight.in_split)):
            owned = [i for row in flight.rounds if (i := row[j]) is not None]
            for i, part in zip(owned, chunk.split([self._size(i, self.me) for i in owned]), strict=True):
                out[i] = part.view(self.blocks[i][self.me], self.shapes[i][1])
