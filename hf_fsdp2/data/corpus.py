"""Continued pre-training data: plain-text documents -> rows of ``max_length`` tokens, loss on every token,
no document truncated or dropped.

A document is tokenized as the tokenizer encodes it (its BOS, if it adds one) followed by EOS. Every token
but a document's first is a target exactly once over an epoch (the first has nothing before it to predict it
from). A document longer than the room left in a row is cut into pieces; each piece after the first starts
with the token before it as context (not a target), so no target is lost at a cut.

Rows, by ``corpus_layout``:

* ``concat``: documents in order, end to end; a row is filled to ``max_length`` tokens and a cut document
  continues at the start of the next row (every row is full but the last, or one short when only a
  document's first token would fit: it is no target, and its document starts the next row with it);
* ``best_fit``: documents cut into pieces of at most ``max_length`` tokens, then packed by best-fit
  decreasing (fewer cuts, a little padding; map-style datasets only).

With ``cross_document_attention: false`` (the default) each document piece is its own sequence
(``seq_lengths``: positions restart, attention stays inside it, as packing does); with ``true`` the
documents of a row form one sequence, as GPT-style pre-training concatenates them (``concat`` only).

Streaming (``streaming: true``): documents come from a ``datasets`` iterable dataset, each rank its own
slice (``split_dataset_by_node``), tokenized on the fly; :class:`StreamingRows` keeps the exact position
(the dataset's own state, which skips to it without re-reading what it can seek past, plus the tokens of
the document being cut) so a resume continues bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hf_fsdp2.data.packing import best_fit_decreasing
from hf_fsdp2.labels import IGNORE_INDEX

CORPUS_LAYOUTS = ("concat", "best_fit")


def document_ids(tokenizer: Any, text: str) -> list[int]:
    """A document's tokens: the tokenizer's encoding (with its BOS, if it adds one) and EOS."""
    # verbose=False: a document longer than the model's context is expected here (it is cut into rows).
    ids = list(tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"])
    if tokenizer.eos_token_id is None:
        raise ValueError("continued pre-training needs a tokenizer with an EOS token to end documents")
    return [*ids, tokenizer.eos_token_id]


def split_document(ids: Sequence[int], first: int, room: int) -> list[tuple[int, int]]:
    """Cut a document into pieces, the first of at most ``first`` tokens, the rest of at most ``room``.

    Every piece after the first starts one token early: that token is context for the piece's first target.

    Returns:
        ``(start, end)`` token ranges of the pieces; every token index ``1..len-1`` is a target (not the first
        token) of exactly one piece.
    """
    pieces: list[tuple[int, int]] = []
    start, size = 0, first
    while True:
        end = min(len(ids), start + size)
        pieces.append((start, end))
        if end >= len(ids):
            return pieces
        start, size = end - 1, room


@dataclass(kw_only=True)
class RowBuilder:
    """Fills rows of ``max_length`` tokens from documents, in order (``concat``), keeping what is carried over.

    ``carry`` holds the rest of a document that did not fit (starting with its one token of context), so the
    builder's state is small and exact: a resume feeds it the same documents from the same place.
    """

    max_length: int
    cross_document_attention: bool = False
    ids: list[int] = field(default_factory=list)
    segments: list[int] = field(default_factory=list)
    carry: list[int] = field(default_factory=list)

    def add(self, doc: list[int]) -> Iterator[dict[str, Any]]:
        """Add a document (or a carried remainder, which starts with its context token); yield every row it
        completes. While a row is handed out, :attr:`carry` holds what of the document is still to place."""
        pending = doc
        while pending:
            room = self.max_length - len(self.ids)
            if room < 2 and self.ids:  # no room for a token with its context: the row is done
                self.carry = pending
                yield self._flush()
                continue
            piece, pending = pending[:room], (pending[room - 1 :] if len(pending) > room else [])
            self.ids.extend(piece)
            if self.cross_document_attention and self.segments:
                self.segments[-1] += len(piece)  # one sequence per row: documents attend to each other
            else:
                self.segments.append(len(piece))
            if len(self.ids) >= self.max_length:
                self.carry = pending
                yield self._flush()
        self.carry = []

    def _flush(self) -> dict[str, Any]:
        row = {"input_ids": self.ids, "labels": list(self.ids), "seq_lengths": self.segments}
        self.ids, self.segments = [], []
        return row

    def finish(self) -> dict[str, Any] | None:
        """The last, partly filled row (None when empty)."""
        return self._flush() if self.ids else None

    def state(self) -> dict[str, Any]:
        return {"ids": list(self.ids), "segments": list(self.segments)}

    def load(self, state: dict[str, Any]) -> None:
        self.ids, self.segments = list(state["ids"]), list(state["segments"])


def concat_rows(
    documents: Iterable[list[int]], max_length: int, *, cross_document_attention: bool = False
) -> list[dict[str, Any]]:
    """Every document end to end in rows of exactly ``max_length`` tokens (but the last)."""
    builder = RowBuilder(max_length=max_length, cross_document_attention=cross_document_attention)
    rows: list[dict[str, Any]] = []
    for doc in documents:
        rows.extend(builder.add(doc))
    last = builder.finish()
    return rows + ([last] if last else [])


def best_fit_rows(documents: Sequence[list[int]], max_length: int) -> list[dict[str, Any]]:
    """Documents cut into pieces of at most ``max_length`` tokens, packed by best-fit decreasing."""
    pieces: list[list[int]] = []
    for doc in documents:
        for start, end in split_document(doc, max_length, max_length):
            if end - start >= 2 or start == 0:
                pieces.append(list(doc[start:end]))
    bins = best_fit_decreasing([len(p) for p in pieces], max_length)
    return [
        {
            "input_ids": [t for i in row for t in pieces[i]],
            "labels": [t for i in row for t in pieces[i]],
            "seq_lengths": [len(pieces[i]) for i in row],
        }
        for row in bins
    ]


def target_positions(row: dict[str, Any]) -> list[int]:
    """Indices of the row's tokens that are targets (each segment's first token is not: the collator
    masks it)."""
    starts = set(np.cumsum([0, *row["seq_lengths"][:-1]]).tolist())
    return [i for i, label in enumerate(row["labels"]) if i not in starts and label != IGNORE_INDEX]


class RowsDataset:
    """Map-style rows (``input_ids``, ``labels``, ``seq_lengths``) for the sampler and `PackedCollator`."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows
        self.row_lengths = np.asarray([len(r["input_ids"]) for r in rows], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.rows[index]


class StreamingRows:
    """Rows built on the fly from a streamed document source, with an exact, resumable position.

    Args:
        documents: a ``datasets.IterableDataset`` of records with a text column (this rank's slice).
        tokenizer: the model's tokenizer.
        max_length: row length.
        text_column: the column holding the document.
        cross_document_attention: as in :func:`concat_rows`.
    """

    def __init__(
        self,
        documents: Any,
        tokenizer: Any,
        max_length: int,
        *,
        text_column: str = "text",
        cross_document_attention: bool = False,
    ) -> None:
        self.documents, self.tokenizer, self.text_column = documents, tokenizer, text_column
        self.builder = RowBuilder(max_length=max_length, cross_document_attention=cross_document_attention)
        self.epoch = 0
        self._source_state: dict[str, Any] | None = None
        self._resume_carry: list[int] = []

    def state_dict(self) -> dict[str, Any]:
        """The position after the last row handed out: the source's state after the document being cut, the
        rest of that document, and the partly filled row."""
        return {
            "epoch": self.epoch,
            "source": self._source_state,
            "carry": list(self.builder.carry),
            "row": self.builder.state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self._source_state = state["source"]
        self._resume_carry = list(state["carry"])
        self.builder.load(state["row"])

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while True:
            docs = self.documents
            if hasattr(docs, "set_epoch"):
                docs.set_epoch(self.epoch)
            if self._source_state is not None:
                docs.load_state_dict(self._source_state)
            if self._resume_carry:  # the rest of the document that was being cut when the state was taken
                carry, self._resume_carry = self._resume_carry, []
                yield from self.builder.add(carry)
            for record in docs:
                self._source_state = docs.state_dict()  # after this document: a resume starts at the next
                text = record.get(self.text_column)
                if not isinstance(text, str) or not text.strip():
                    continue  # a document without text: nothing to train on
                yield from self.builder.add(document_ids(self.tokenizer, text))
            self.epoch, self._source_state = self.epoch + 1, None
