"""Packing several examples per row, padding-free batches, and padding efficiency.

Packing groups tokenized examples (each at most ``max_length`` tokens) into rows of at most
``max_length`` tokens by best-fit decreasing, once and deterministically, before sampling: the sampler
then indexes packed rows, so a resume stays O(1). Padding-free batches go further and flatten a whole
micro-batch (of examples or of packed rows) into one row without any padding.

How the model keeps the examples apart: `PackedCollator` returns ``input_ids``, ``labels`` and
``position_ids`` that restart at 0 for every example, and no ``attention_mask``; the model is called with
``use_cache=False`` (transformers looks for examples in the position ids only without a mask and a KV cache).
The first label of every example is ``IGNORE_INDEX``, so the last token of one example is never trained to
predict the first token of the next. What reaches the attention kernel then depends on the kernel:

- ``sdpa``, ``eager``: a dense block-diagonal causal mask ``[rows, 1, T, T]`` that transformers builds from
  the position ids row by row (``masking_utils.find_packed_sequence_indices``), at any number of rows;
- ``flex_attention``: the same blocks as a ``BlockMask``;
- ``flash_attention_2``/``_3``: no mask. transformers' flash path finds the examples in the position ids only
  when the batch has one row (``modeling_flash_attention_utils._is_packed_sequence``), and then runs the varlen
  kernel with ``cu_seqlens`` at every restart; a batch of several rows runs the plain causal kernel on each row,
  every example attending to the examples before it in its row. So under these kernels rows of several examples
  are always flattened into one row (``padding_free``: `hf_fsdp2.attention_layout.choose_attention_layout`
  decides it, and refuses ``padding_free: false`` there);
- context parallel (all-to-all): `hf_fsdp2.parallel.all_to_all.cp_attention` gathers whole rows and builds the
  block mask from their positions (sdpa, eager), or hands a flash kernel the boundaries explicitly
  (``cu_seq_lens_q/k``, ``max_length_q/k``, which transformers' varlen path takes at any number of rows).

tests/unit/test_packing.py proves, for sdpa, eager and flex_attention on CPU, that the per-token losses of a
packed batch equal those of each example run alone; tests/unit/test_packed_flash.py proves it for the flash
path (a stand-in varlen kernel behind transformers' own flash code records what it receives) for packed SFT
rows, continued pre-training's rows and the context-parallel branch, at several rows per micro-batch.

Padding efficiency = target-bearing tokens / tokens processed (every position of the batch tensor).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np
import torch
from torch.utils.data import Dataset as TorchDataset

from hf_fsdp2.data.loader import ShardedSampler
from hf_fsdp2.labels import IGNORE_INDEX


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Group items into bins of total length at most ``capacity``, by best-fit decreasing.

    Items are placed longest first (ties: lower index first), each into the open bin whose free space
    is the smallest that still fits it (ties: the bin opened first), or into a new bin. The result
    depends only on ``lengths`` and ``capacity``. Free spaces are integers up to ``capacity``, so the
    search is a bisection over the sorted distinct free spaces: O(n log capacity) plus a list shift.

    Args:
        lengths: Length of every item, each in ``[1, capacity]``.
        capacity: Bin size (``max_length``).

    Returns:
        The bins, in the order they were opened; each lists item indices, longest first.

    Raises:
        ValueError: ``capacity < 1`` or an item length outside ``[1, capacity]``.
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}.")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    bins_with_space: dict[int, deque[int]] = {}  # free space -> bins with exactly that much, oldest first
    spaces: list[int] = []  # sorted distinct free spaces that have bins
    for item in order:
        n = int(lengths[item])
        if not 1 <= n <= capacity:
            raise ValueError(
                f"Item {item} has length {n}, outside [1, {capacity}]; truncate or drop it first."
            )
        at = bisect.bisect_left(spaces, n)
        if at < len(spaces):
            space = spaces[at]
            queue = bins_with_space[space]
            target = queue.popleft()
            if not queue:
                del bins_with_space[space]
                spaces.pop(at)
        else:
            space, target = capacity, len(bins)
            bins.append([])
        bins[target].append(item)
        left = space - n
        if left > 0:
            if left not in bins_with_space:
                bins_with_space[left] = deque()
                bisect.insort(spaces, left)
            bins_with_space[left].append(target)
    return bins


class PackedDataset(TorchDataset[dict[str, Any]]):
    """Rows of several tokenized examples, concatenated on access (the examples are not copied).

    Item ``i`` is ``{"input_ids", "labels", "seq_lengths"}``: the examples of row ``i`` end to end and
    the length of each, which `PackedCollator` turns into restarting ``position_ids``.
    """

    def __init__(self, examples: datasets.Dataset, rows: list[list[int]], max_length: int) -> None:
        """Wrap ``examples`` grouped into ``rows`` (lists of example indices), e.g. from `pack_examples`."""
        self.examples = examples
        self.rows = rows
        self.max_length = max_length
        lengths = np.asarray(examples["length"][:], dtype=np.int64)
        targets = np.asarray(examples["num_targets"][:], dtype=np.int64)
        self.row_lengths = np.asarray([int(lengths[row].sum()) for row in rows], dtype=np.int64)
        self.row_targets = np.asarray([int(targets[row].sum()) for row in rows], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        batch = self.examples[self.rows[index]]
        return {
            "input_ids": [token for ids in batch["input_ids"] for token in ids],
            "labels": [label for labels in batch["labels"] for label in labels],
            "seq_lengths": [len(ids) for ids in batch["input_ids"]],
        }


def pack_examples(examples: datasets.Dataset, max_length: int) -> PackedDataset:
    """Pack tokenized examples into rows of at most ``max_length`` tokens (`best_fit_decreasing`).

    Args:
        examples: Output of `hf_fsdp2.data.tokenize.tokenize_dataset` / `build_sft_datasets` (needs ``length``
            and ``num_targets`` columns); every example at most ``max_length`` tokens.
        max_length: Row capacity.

    Returns:
        The packed rows.

    Raises:
        ValueError: An example longer than ``max_length`` or without tokens.
    """
    lengths = examples["length"][:]
    return PackedDataset(examples, best_fit_decreasing(lengths, max_length), max_length)


@dataclass
class PackedCollator:
    """Collate examples or packed rows for attention that separates examples by ``position_ids``.

    Returns ``input_ids``, ``labels`` and ``position_ids`` (restarting at 0 for every example) and no
    ``attention_mask``; the first label of every example is ``IGNORE_INDEX``. Without
    ``padding_free`` the rows are right-padded to the longest (padding gets its own positions 0, 1, ...,
    so it forms a separate sequence that nothing real attends to, and ``IGNORE_INDEX`` labels); with
    ``padding_free`` the whole batch is flattened into one row of shape ``(1, total_tokens)``, the only layout in
    which transformers' flash path keeps the examples apart (the module's docstring says what each kernel gets).

    Attributes:
        pad_token_id: Id written into padding positions.
        padding_free: Flatten the batch into one row without padding.
        pad_to_multiple_of: Round the row length up to a multiple of this (None: no rounding).
    """

    pad_token_id: int
    padding_free: bool = False
    pad_to_multiple_of: int | None = None

    def __call__(self, examples: Sequence[Mapping[str, Sequence[int]]]) -> dict[str, torch.Tensor]:
        """Collate.

        Args:
            examples: Tokenized examples (``input_ids``, ``labels``) or `PackedDataset` rows (plus
                ``seq_lengths``).

        Returns:
            ``input_ids``, ``labels``, ``position_ids``: LongTensors of shape ``(batch, length)``, or
            ``(1, total)`` when ``padding_free``.

        Raises:
            ValueError: An empty batch, or an example whose lengths disagree.
        """
        if not examples:
            raise ValueError("PackedCollator got an empty batch.")
        rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for i, example in enumerate(examples):
            ids = np.asarray(example["input_ids"], dtype=np.int64)
            labels = np.array(example["labels"], dtype=np.int64)  # a copy: first labels are overwritten
            seq_lengths = list(example.get("seq_lengths") or [len(ids)])
            if len(labels) != len(ids) or sum(seq_lengths) != len(ids):
                raise ValueError(
                    f"Example {i} of the batch has {len(ids)} input_ids, {len(labels)} labels and sequence "
                    f"lengths {seq_lengths}; they must agree."
                )
            starts = np.cumsum([0, *seq_lengths[:-1]])
            labels[starts] = IGNORE_INDEX
            positions = np.arange(len(ids)) - np.repeat(starts, seq_lengths)
            rows.append((ids, labels, positions))
        if self.padding_free:
            rows = [
                (
                    np.concatenate([r[0] for r in rows]),
                    np.concatenate([r[1] for r in rows]),
                    np.concatenate([r[2] for r in rows]),
                )
            ]
        width = max(len(ids) for ids, _, _ in rows)
        if self.pad_to_multiple_of is not None:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        labels_out = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        position_ids = torch.zeros((len(rows), width), dtype=torch.long)
        for r, (ids, labels, positions) in enumerate(rows):
            n = len(ids)
            input_ids[r, :n] = torch.from_numpy(ids)
            labels_out[r, :n] = torch.from_numpy(labels)
            position_ids[r, :n] = torch.from_numpy(positions)
            position_ids[r, n:] = torch.arange(width - n)
        return {"input_ids": input_ids, "labels": labels_out, "position_ids": position_ids}


def expected_padding_efficiency(
    lengths: Sequence[int] | np.ndarray,
    targets: Sequence[int] | np.ndarray,
    *,
    batch_size: int,
    world_size: int,
    seed: int,
    padding_free: bool = False,
) -> float:
    """Target-bearing tokens / tokens processed over epoch 0, batched as the training loader will.

    Follows `ShardedSampler`'s epoch-0 order on every rank and the DataLoader's ``drop_last`` batches;
    a padded batch processes ``batch_size x longest`` tokens, a padding-free one the sum of lengths.

    Args:
        lengths: Tokens of every example or packed row.
        targets: Target tokens of every example or row (``num_targets``, or `PackedDataset.row_targets`).
        batch_size: Examples or rows per micro-batch per rank.
        world_size: Data-parallel ranks.
        seed: The sampler's seed.
        padding_free: Batches flattened without padding.

    Returns:
        The efficiency in ``[0, 1]`` (0 when no full batch exists).
    """
    lengths_arr, targets_arr = np.asarray(lengths, dtype=np.int64), np.asarray(targets, dtype=np.int64)
    order = np.asarray(
        ShardedSampler(len(lengths_arr), rank=0, world_size=world_size, seed=seed).global_order(0)
    )
    processed = trained = 0
    for rank in range(world_size):
        mine = order[rank::world_size]
        full = len(mine) // batch_size * batch_size
        batches = mine[:full].reshape(-1, batch_size)
        if len(batches) == 0:
            continue
        batch_lengths = lengths_arr[batches]
        processed += int(
            batch_lengths.sum() if padding_free else (batch_lengths.max(axis=1) * batch_size).sum()
        )
        trained += int(targets_arr[batches].sum())
    return trained / processed if processed else 0.0


def layout_summary(
    examples: datasets.Dataset,
    packed: PackedDataset | None,
    *,
    batch_size: int,
    world_size: int,
    seed: int,
    padding_free: bool,
) -> str:
    """One log line: the batch layout and its expected padding efficiency next to plain padded batches.

    Args:
        examples: The tokenized training examples.
        packed: Their packed rows, or None without packing.
        batch_size: Examples (or rows) per micro-batch per rank.
        world_size: Data-parallel ranks.
        seed: The sampler's seed.
        padding_free: Batches flattened without padding.

    Returns:
        The line.
    """

    def efficiency(lengths: Any, targets: Any, flat: bool = False) -> float:
        return expected_padding_efficiency(
            lengths, targets, batch_size=batch_size, world_size=world_size, seed=seed, padding_free=flat
        )

    lengths, targets = examples["length"][:], examples["num_targets"][:]
    padded = efficiency(lengths, targets)
    line = (
        f"data layout: expected padding efficiency (target tokens / tokens processed, epoch 0): "
        f"padded {padded:.1%}"
    )
    if packed is not None:
        kind = "packed, padding-free" if padding_free else "packed"
        packed_efficiency = efficiency(packed.row_lengths, packed.row_targets, padding_free)
        line += (
            f" vs {kind} {packed_efficiency:.1%}; {len(examples)} examples packed (best-fit decreasing) "
            f"into {len(packed)} rows of <= {packed.max_length} tokens, {batch_size} rows per micro-batch"
        )
    elif padding_free:
        line += f" vs padding-free {efficiency(lengths, targets, True):.1%}"
    else:
        line += " (packing=false, padding_free=false)"
    return line
