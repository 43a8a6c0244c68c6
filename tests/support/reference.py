"""What the single-process reference loops of the parity tests share: the documented data order and padding.

Plain PyTorch only (no hf_fsdp2 code): the order is a permutation seeded with seed + epoch, truncated to
a multiple of the world size, rank r taking every world-th index, cut into micro-batches per rank.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def pad_batch(examples: list[dict], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad ``input_ids``/``labels`` examples: (input_ids, attention_mask, labels)."""
    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), width), pad_id)
    labels = torch.full((len(examples), width), -100)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[i, :n] = torch.tensor(e["input_ids"])
        labels[i, :n] = torch.tensor(e["labels"])
        mask[i, :n] = 1
    return ids, mask, labels


def step_micro_batches(
    n: int, *, world: int, batch_size: int, accum: int, seed: int, steps: int
) -> Iterator[list[list[int]]]:
    """For each optimizer step, the index lists of all its micro-batches on all ranks."""
    per_rank_batches = (n // world) // batch_size

    def rank_batches(epoch: int) -> list[list[list[int]]]:
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        perm = perm[: n - n % world]
        return [
            [perm[r::world][k * batch_size : (k + 1) * batch_size] for k in range(per_rank_batches)]
            for r in range(world)
        ]

    epoch, cursor, batches = 0, 0, rank_batches(0)
    for _ in range(steps):
        micro: list[list[int]] = []
        for _ in range(accum):
            if cursor >= per_rank_batches:
                epoch, cursor, batches = epoch + 1, 0, rank_batches(epoch + 1)
            micro.extend(batches[r][cursor] for r in range(world))
            cursor += 1
        yield micro
