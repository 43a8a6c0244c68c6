"""Batching and sampling: the padding collator, the resumable sharded sampler, the DataLoader.

Packing several examples per row and padding-free batches live in `hf_fsdp2.data.packing`."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import datasets
import torch
from torch.utils.data import DataLoader, Sampler
from torch.utils.data import Dataset as TorchDataset

from hf_fsdp2.labels import IGNORE_INDEX

if TYPE_CHECKING:
    pass


@dataclass
class PaddingCollator:
    """Right-pad examples into a batch of LongTensors.

    Attributes:
        pad_token_id: Id written into padded ``input_ids`` positions (masked by ``attention_mask`` and
            ``labels``, so its value does not change the loss).
        pad_to_multiple_of: Round the padded length up to a multiple of this (e.g. 8 or 64 for tensor
            cores, or to cut torch.compile recompilations); ``None`` pads to the longest example.
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, examples: Sequence[Mapping[str, Sequence[int]]]) -> dict[str, torch.Tensor]:
        """Collate examples.

        Args:
            examples: Dicts with ``input_ids`` and ``labels`` of equal length (other keys are ignored).

        Returns:
            ``input_ids``, ``attention_mask`` and ``labels``, each a ``(batch, length)`` LongTensor;
            ``labels`` are padded with ``IGNORE_INDEX``, ``attention_mask`` is 0 on padding.

        Raises:
            ValueError: An empty batch, or an example whose ``input_ids`` and ``labels`` differ in length.
        """
        if not examples:
            raise ValueError("PaddingCollator got an empty batch.")
        for i, example in enumerate(examples):
            if len(example["input_ids"]) != len(example["labels"]):
                raise ValueError(
                    f"Example {i} of the batch has {len(example['input_ids'])} input_ids but "
                    f"{len(example['labels'])} labels; tokenize with tokenize_dataset."
                )
        length = max(len(example["input_ids"]) for example in examples)
        if self.pad_to_multiple_of is not None:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of

        input_ids = torch.full((len(examples), length), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(examples), length), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
        for row, example in enumerate(examples):
            n = len(example["input_ids"])
            input_ids[row, :n] = torch.as_tensor(example["input_ids"], dtype=torch.long)
            labels[row, :n] = torch.as_tensor(example["labels"], dtype=torch.long)
            attention_mask[row, :n] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class ShardedSampler(Sampler[int]):
    """Deterministic, per-rank, resumable sampler over a map-style dataset.

    Each epoch uses the permutation ``torch.randperm(num_examples)`` drawn from a generator seeded with
    ``seed + epoch`` (the identity when ``shuffle=False``), so every rank computes the same order with no
    communication. The order is cut to a multiple of ``world_size``: the last
    ``num_examples % world_size`` indices of each epoch are dropped so that every rank yields the same
    number of indices (unequal counts would leave one rank waiting in a collective). Shuffling draws a
    different tail each epoch. Rank ``r`` takes ``order[r::world_size]``.

    The sampler runs in the main process; DataLoader workers only fetch the indices it yields, so the
    order is the same whatever ``num_workers``. With packing it indexes packed rows (packed once,
    deterministically, before sampling), so resuming stays O(1).

    ``state_dict()`` records the epoch and how many indices this rank has yielded; ``load_state_dict``
    restores both and the next ``__iter__`` continues from there without replaying the yielded part.
    The position counts indices handed to the DataLoader, which runs ahead of the training loop by its
    prefetch when ``num_workers > 0``; a recipe that saves mid-epoch with workers should store
    ``batches_consumed * batch_size`` as the position instead.
    """

    def __init__(
        self, num_examples: int, *, rank: int, world_size: int, seed: int, shuffle: bool = True
    ) -> None:
        """Create the sampler for one rank.

        Args:
            num_examples: Length of the dataset.
            rank: This process's data-parallel rank, in ``[0, world_size)``.
            world_size: Number of data-parallel ranks.
            seed: Base seed, identical on every rank.
            shuffle: Shuffle each epoch; ``False`` keeps dataset order.

        Raises:
            ValueError: ``world_size < 1``, ``rank`` out of range, or fewer examples than ranks.
        """
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}.")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}.")
        if num_examples < world_size:
            raise ValueError(
                f"The dataset has {num_examples} examples but there are {world_size} ranks, so some ranks "
                "would get none. Use more data or fewer processes."
            )
        self.num_examples = num_examples
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0

    def __len__(self) -> int:
        """Indices this rank yields per epoch (the same on every rank)."""
        return self.num_examples // self.world_size

    def global_order(self, epoch: int) -> list[int]:
        """The epoch's order across all ranks, already cut to a multiple of ``world_size``.

        Args:
            epoch: Epoch number.

        Returns:
            ``len(self) * world_size`` distinct dataset indices; rank ``r`` takes ``[r::world_size]``.
        """
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            order: list[int] = torch.randperm(self.num_examples, generator=generator).tolist()
        else:
            order = list(range(self.num_examples))
        return order[: len(self) * self.world_size]

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next ``__iter__`` yields.

        Moving to a different epoch restarts at its beginning; setting the current epoch again keeps the
        position, so a recipe may call ``set_epoch(epoch)`` after ``load_state_dict`` and still resume
        mid-epoch.

        Args:
            epoch: Epoch number, ``>= 0``.

        Raises:
            ValueError: A negative epoch.
        """
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}.")
        if epoch != self.epoch:
            self.epoch = epoch
            self.position = 0

    def __iter__(self) -> Iterator[int]:
        """Yield this rank's remaining indices of the current epoch.

        An epoch already fully yielded yields nothing: call ``set_epoch(epoch + 1)`` between epochs.
        """
        mine = self.global_order(self.epoch)[self.rank :: self.world_size]
        while self.position < len(mine):
            index = mine[self.position]
            # Counted before yielding: once the consumer holds the index it has been handed out.
            self.position += 1
            yield index

    def start_at(self, epoch: int, position: int) -> None:
        """Start ``epoch`` at this rank's index ``position`` (O(1): earlier indices are skipped, not replayed).

        Raises:
            ValueError: a position outside ``[0, len(self)]`` (e.g. the dataset or the number of ranks changed
                since the position was saved).
        """
        if epoch < 0 or not 0 <= position <= len(self):
            raise ValueError(
                f"data position epoch={epoch} position={position} does not fit this sampler "
                f"({len(self)} indices per rank: {self.num_examples} examples over {self.world_size} ranks). "
                "Resume with the same dataset, max_length, packing and number of processes as the saved run."
            )
        self.epoch, self.position = epoch, position


def build_dataloader(
    dataset: datasets.Dataset | TorchDataset[dict[str, Any]],
    *,
    batch_size: int,
    collator: Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]],
    sampler: Sampler[int],
    num_workers: int = 0,
) -> DataLoader[dict[str, Any]]:
    """Build the training DataLoader; incomplete last batches are dropped.

    ``drop_last=True`` keeps every step's batch shape identical on every rank (no extra torch.compile
    shapes, no rank with a smaller batch).

    Args:
        dataset: Tokenized dataset from `tokenize_dataset`, or packed rows (`hf_fsdp2.data.packing.PackedDataset`).
        batch_size: Examples (or packed rows) per batch per rank.
        collator: Turns a list of examples into tensors, e.g. `PaddingCollator`.
        sampler: Yields this rank's dataset indices, e.g. `ShardedSampler`.
        num_workers: DataLoader worker processes (0 loads in the main process).

    Returns:
        The DataLoader.

    Raises:
        ValueError: ``batch_size < 1``, or fewer indices per rank than ``batch_size`` (zero batches).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    if len(cast(Any, sampler)) < batch_size:
        raise ValueError(
            f"The sampler yields {len(cast(Any, sampler))} examples per rank, fewer than batch_size="
            f"{batch_size}, so there would be no batch. Lower batch_size or use more data."
        )
    # datasets.Dataset is map-style (__getitem__ + __len__) without subclassing torch's Dataset.
    return DataLoader(
        cast(TorchDataset[dict[str, Any]], dataset),
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=collator,
        num_workers=num_workers,
        drop_last=True,
    )


class DataStream:
    """Micro-batches across epochs, and the one record of where the run is in its data.

    The position counts micro-batches *consumed* (handed to the training loop), not indices the sampler has
    yielded: a DataLoader with workers prefetches ahead. Each epoch reshuffles with ``seed + epoch``.
    """

    # No attribute beyond these: a method's code cannot hand the loop something through the stream (a write such
    # as ``stream.holder = ...`` raises); subclasses declare ``__slots__`` too.
    __slots__ = ("batch_size", "batches_in_epoch", "epoch", "loader", "sampler")

    def __init__(self, loader: DataLoader, sampler: ShardedSampler, batch_size: int) -> None:
        self.loader, self.sampler, self.batch_size = loader, sampler, batch_size
        self.epoch = 0
        self.batches_in_epoch = 0

    def start_at(self, epoch: int, batches_in_epoch: int) -> None:
        """Continue from a saved position (before iterating)."""
        self.sampler.start_at(epoch, batches_in_epoch * self.batch_size)
        self.epoch, self.batches_in_epoch = epoch, batches_in_epoch

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            self.sampler.set_epoch(self.epoch)  # the same epoch keeps a resumed position
            for batch in self.loader:
                self.batches_in_epoch += 1
                yield batch
            self.epoch, self.batches_in_epoch = self.epoch + 1, 0
