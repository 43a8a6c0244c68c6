"""Micro-batches of image examples: the processor's image inputs beside the tokenized rows.

Each document with images goes through the model's processor again (its full render and its images, kept by
`hf_fsdp2.data.vision_encode`): the pixels and the family's other inputs (image grids, pixel masks, token types) are
the processor's own, and the ids it gives must be the tokenized ones (a check, not a trust). A text document gets the
processor's per-token keys as zeros (what it gives a text-only call). Then:

- padded batches (one document per row): right-padded as TRL's collator pads them (``attention_mask``), the positions
  left to the model (Qwen's 3-D ones included);
- rows of several documents (packing, padding-free batches): no ``attention_mask``; ``position_ids`` restart at every
  document, and for Qwen's mRoPE they are ``[4, rows, T]``, the text positions then each document's 3-D positions
  from the class's own ``get_rope_index`` (`hf_fsdp2.vision.positions`); the first label of every document is
  ``IGNORE_INDEX``.

Image inputs follow the documents' order: one flat list of images (or patches, with their grids) for the batch, or,
for Idefics3, one list per row padded with all-zero images, which the model drops.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import datasets
import torch
from torch.utils.data import Dataset as TorchDataset

from hf_fsdp2.labels import IGNORE_INDEX

_TEXT_KEYS = ("input_ids", "attention_mask")


@dataclass
class _Document:
    ids: torch.Tensor
    labels: torch.Tensor
    sequence: dict[str, torch.Tensor]  # per-token keys of the processor, [T]
    images: dict[str, torch.Tensor] = field(default_factory=dict)


class VisionPackedRows(TorchDataset[dict[str, Any]]):
    """Rows of several image examples (the packing of `hf_fsdp2.data.packing.pack_examples`): item ``i`` is
    ``{"documents": [example, ...]}``, each example with its images, for :class:`VisionCollator`."""

    def __init__(self, examples: datasets.Dataset, rows: list[list[int]]) -> None:
        self.examples, self.rows = examples, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"documents": [self.examples[i] for i in self.rows[index]]}


def sequence_keys(processor: Any) -> tuple[str, ...]:
    """The per-token keys a processor returns beside ``input_ids`` and ``attention_mask`` (Gemma 3's
    ``token_type_ids``, Qwen's ``mm_token_type_ids``), from a text-only call."""
    out = processor(text=["a b"], add_special_tokens=False, return_tensors="pt")
    width = out["input_ids"].shape[-1]
    return tuple(
        k
        for k, v in out.items()
        if k not in _TEXT_KEYS and isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[-1] == width
    )


@dataclass(kw_only=True)
class VisionCollator:
    """Collate image examples (or :class:`VisionPackedRows` rows) into a micro-batch (see the module docstring).

    Attributes:
        processor: the model's processor.
        pad_token_id: the id written into padding.
        several_documents: rows of several documents (packing or padding-free): restarting positions, no mask.
        padding_free: the whole micro-batch flattened into one row.
        row_batched: the image keys laid out ``[rows, images, ...]`` (Idefics3).
        sequence: the processor's per-token keys (:func:`sequence_keys`).
        rope_index: a document's ``[3, T]`` mRoPE positions (Qwen), for rows of several documents.
    """

    processor: Any
    pad_token_id: int
    several_documents: bool = False
    padding_free: bool = False
    row_batched: tuple[str, ...] = ()
    sequence: tuple[str, ...] = ()
    rope_index: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None

    def document(self, example: Mapping[str, Any]) -> _Document:
        """One tokenized example with its processed images.

        Raises:
            ValueError: the processor gives other ids than the tokenized ones.
        """
        ids = torch.as_tensor(example["input_ids"], dtype=torch.long)
        labels = torch.as_tensor(example["labels"], dtype=torch.long)
        images = list(example.get("images") or [])
        if not images:
            return _Document(ids, labels, {k: torch.zeros_like(ids) for k in self.sequence})
        out = self.processor(
            text=[example["text"]], images=[images], add_special_tokens=False, return_tensors="pt"
        )
        got = out["input_ids"][0, : len(ids)]
        if not torch.equal(got, ids):
            raise ValueError(
                f"{type(self.processor).__name__} gives this example other token ids than when it was tokenized "
                f"(first difference at position {int((got != ids).nonzero()[0, 0]) if len(got) == len(ids) else len(got)} "
                f"of {len(ids)}): the datasets cache was written with another processor or template; delete the "
                "cache (~/.cache/huggingface/datasets) or the run's data cache and start again"
            )
        sequence = {k: out[k][0, : len(ids)].long() for k in self.sequence if k in out}
        rest = {k: v for k, v in out.items() if k not in (*_TEXT_KEYS, *self.sequence)}
        return _Document(ids, labels, sequence, {k: torch.as_tensor(v) for k, v in rest.items()})

    def _positions(self, doc: _Document) -> torch.Tensor:
        text = torch.arange(len(doc.ids))
        if self.rope_index is None:
            return text
        kinds = doc.sequence.get("mm_token_type_ids", torch.zeros_like(doc.ids))
        return torch.cat([text[None], self.rope_index(doc.ids, kinds, doc.images.get("image_grid_thw"))])

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        """Collate ``examples`` (tokenized image examples, or rows of them)."""
        if not examples:
            raise ValueError("VisionCollator got an empty batch.")
        rows = [[self.document(d) for d in e.get("documents", [e])] for e in examples]
        if self.padding_free:
            rows = [[d for row in rows for d in row]]
        width = max(sum(len(d.ids) for d in row) for row in rows)
        batch: dict[str, torch.Tensor] = {
            "input_ids": torch.full((len(rows), width), self.pad_token_id, dtype=torch.long),
            "labels": torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long),
            **{k: torch.zeros((len(rows), width), dtype=torch.long) for k in self.sequence},
        }
        if self.several_documents:
            planes = 4 if self.rope_index is not None else 1
            positions = torch.zeros((planes, len(rows), width), dtype=torch.long)
        else:
            batch["attention_mask"] = torch.zeros((len(rows), width), dtype=torch.long)
        for r, row in enumerate(rows):
            at = 0
            for doc in row:
                n = len(doc.ids)
                batch["input_ids"][r, at : at + n] = doc.ids
                batch["labels"][r, at : at + n] = doc.labels
                if self.several_documents:
                    batch["labels"][r, at] = (
                        IGNORE_INDEX  # the previous document's last token predicts nothing
                    )
                    positions[:, r, at : at + n] = self._positions(doc)
                for k in self.sequence:
                    batch[k][r, at : at + n] = doc.sequence[k]
                at += n
            if self.several_documents:
                positions[:, r, at:] = torch.arange(width - at)  # padding: a sequence of its own
            else:
                batch["attention_mask"][r, :at] = 1
        if self.several_documents:
            batch["position_ids"] = positions if self.rope_index is not None else positions[0]
        batch.update(self._images(rows))
        return batch

    def _images(self, rows: list[list[_Document]]) -> dict[str, torch.Tensor]:
        keys = sorted({k for row in rows for d in row for k in d.images})
        out = {}
        for key in keys:
            if key not in self.row_batched:
                out[key] = torch.cat([d.images[key] for row in rows for d in row if key in d.images])
                continue
            per_row = [[d.images[key] for d in row if key in d.images] for row in rows]
            template = next(t for row in per_row for t in row)
            joined = [torch.cat(row, dim=1) if row else template[:, :0] for row in per_row]
            most = max(t.shape[1] for t in joined)
            out[key] = torch.cat(
                [
                    torch.cat([t, t.new_zeros((1, most - t.shape[1], *t.shape[2:]))], dim=1)
                    if t.shape[1] < most
                    else t
                    for t in joined
                ]
            )
        return out


def vision_collator(
    processor: Any, model_config: Any, *, pad_token_id: int, packing: bool, padding_free: bool
) -> VisionCollator:
    """The collator of an image run of the composite ``model_config`` describes.

    Raises:
        ConfigError: a model this version does not train on images, or rows of several documents it cannot keep
            apart (:mod:`hf_fsdp2.vision.families`).
    """
    from hf_fsdp2.vision.families import check_rows, image_training
    from hf_fsdp2.vision.positions import RopeIndex

    row = image_training(model_config)
    check_rows(row, packing=packing, padding_free=padding_free)
    several = packing or padding_free
    return VisionCollator(
        processor=processor,
        pad_token_id=pad_token_id,
        several_documents=several,
        padding_free=padding_free,
        row_batched=row.row_batched,
        sequence=sequence_keys(processor),
        rope_index=RopeIndex(model_config) if row.mrope and several else None,
    )
