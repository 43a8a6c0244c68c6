"""The continued-pre-training recipe's data: plain-text documents -> rows of ``max_length`` tokens (loss on
every token, nothing truncated or dropped; see ``hf_fsdp2.data.corpus``) -> micro-batches.

Map-style corpora are tokenized once (rank 0 first, cached by ``datasets``), cut into rows deterministically
and sampled like SFT examples (resume by position). Streamed corpora (``streaming: true``) are read, tokenized
and cut on the fly, each rank its own slice, and each rank's exact position goes into the checkpoints.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import datasets
import numpy as np
import torch

from hf_fsdp2.collectives import rank0_first
from hf_fsdp2.config import ConfigError
from hf_fsdp2.config.sources import DataSource
from hf_fsdp2.data.corpus import RowsDataset, StreamingRows, best_fit_rows, concat_rows, document_ids
from hf_fsdp2.data.loading import load_source, stream_source
from hf_fsdp2.data.mixture import _weighted_indices
from hf_fsdp2.data.packing import PackedCollator
from hf_fsdp2.run.data import TrainData, examples_per_step, logged_layout, sampled_stream
from hf_fsdp2.run.session import Session

logger = logging.getLogger("hf_fsdp2")


def _documents(
    source: DataSource,
    tokenizer: Any,
    *,
    text_column: str,
    text_unit: str,
    on_bad_record: str,
    seed: int,
    salt: int,
    hold_out: float = 0.0,
) -> tuple[list[list[int]], list[list[int]], int]:
    """A source's documents, tokenized (cached), a seeded ``hold_out`` fraction set apart for eval first, the
    rest weight-selected; and how many empty records were skipped.

    Raises:
        ValueError: no ``text_column`` (naming the columns found), or (``on_bad_record=error``) a record without
            text, naming the source and the record.
    """
    raw = load_source(source, on_bad_record=on_bad_record, text_unit=text_unit)
    if text_column not in raw.column_names:
        raise ValueError(
            f"{source.describe()}: continued pre-training reads the {text_column!r} column, which it lacks "
            f"(columns: {raw.column_names}); set text_column or dataset_column_mapping"
        )
    texts = raw[text_column]
    empty = [i for i, text in enumerate(texts) if not isinstance(text, str) or not text.strip()]
    if empty and on_bad_record != "skip":
        raise ValueError(
            f"{source.describe()} record {empty[0]}: a document with no text ({len(empty)} such records); "
            "remove them, or set on_bad_record=skip to skip them (they are counted)"
        )
    dropped = set(empty)
    kept = raw.select([i for i in range(len(raw)) if i not in dropped]) if empty else raw
    tokenized = kept.map(
        lambda batch: {"ids": [document_ids(tokenizer, text) for text in batch[text_column]]},
        batched=True,
        remove_columns=kept.column_names,
        desc=f"Tokenizing {source.describe()}",
    )
    ids = tokenized["ids"]
    held: list[list[int]] = []
    if hold_out > 0:
        n_eval = round(hold_out * len(ids))
        if not 0 < n_eval < len(ids):
            raise ValueError(
                f"eval_split_fraction={hold_out} holds out {n_eval} of the {len(ids)} documents of "
                f"{source.describe()}; it must leave at least one for each side"
            )
        order = np.random.default_rng([seed, salt, 1]).permutation(len(ids))
        held = [ids[i] for i in np.sort(order[:n_eval])]
        ids = [ids[i] for i in np.sort(order[n_eval:])]
    return [ids[i] for i in _weighted_indices(len(ids), source.weight, seed, salt)], held, len(empty)


class StreamingBatches:
    """Micro-batches of rows from a streamed corpus, and this rank's exact position (``state_dict``)."""

    def __init__(self, rows: StreamingRows, collator: Any, batch_size: int) -> None:
        self.rows, self.collator, self.batch_size = rows, collator, batch_size
        self.batches_in_epoch = 0

    @property
    def epoch(self) -> int:
        return self.rows.epoch

    def state_dict(self) -> dict[str, Any]:
        return {"rows": self.rows.state_dict(), "batches_in_epoch": self.batches_in_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rows.load_state_dict(state["rows"])
        self.batches_in_epoch = int(state["batches_in_epoch"])

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        rows = iter(self.rows)
        while True:
            batch = [next(rows) for _ in range(self.batch_size)]
            self.batches_in_epoch += 1
            yield self.collator(batch)


def build_cpt_data(session: Session, tokenizer: Any) -> TrainData:
    """The run's corpus as a stream of micro-batches (every rank; rank 0 tokenizes first when map-style).

    Raises:
        ConfigError / ValueError / FileNotFoundError: bad data, raised on every rank as one error.
    """
    d, t = session.cfg.data, session.cfg.train
    # Rows of several documents (unless cross_document_attention), full already: padding-free only when asked,
    # and then warned about where it builds a dense mask (the same decision as SFT's and the memory plan's).
    layout = logged_layout(session, "corpus")
    collator = PackedCollator(pad_token_id=tokenizer.pad_token_id, padding_free=layout.padding_free)
    if d.streaming:
        return _streamed(session, tokenizer, collator)

    def load() -> tuple[list[list[int]], list[list[int]], int]:
        docs: list[list[int]] = []
        held: list[list[int]] = []
        skipped = 0
        for salt, source in enumerate(d.sources()):
            part, out, empty = _documents(
                source,
                tokenizer,
                text_column=d.text_column,
                text_unit=d.text_unit,
                on_bad_record=d.on_bad_record,
                seed=t.seed,
                salt=salt,
                hold_out=d.eval_split_fraction,
            )
            docs.extend(part)
            held.extend(out)
            skipped += empty
        eval_source = d.eval_source()
        if eval_source is not None:
            held, _, _ = _documents(
                eval_source,
                tokenizer,
                text_column=d.text_column,
                text_unit=d.text_unit,
                on_bad_record=d.on_bad_record,
                seed=t.seed,
                salt=len(d.sources()),
            )
        return docs, held, skipped

    docs, held, skipped = rank0_first(load)
    # Eval: the held-out documents cut into rows the same way (every document whole, loss on every token).
    eval_set = (
        RowsDataset(concat_rows(held, d.max_length, cross_document_attention=d.cross_document_attention))
        if held
        else None
    )
    if eval_set is not None:
        logger.info("eval corpus: %d documents -> %d rows", len(held), len(eval_set))
    if not docs:
        raise ConfigError("the corpus has no document with text; check dataset_name and text_column")
    if d.corpus_layout == "concat":
        rows = concat_rows(docs, d.max_length, cross_document_attention=d.cross_document_attention)
    else:
        rows = best_fit_rows(docs, d.max_length)
    dataset = RowsDataset(rows)
    tokens = sum(len(doc) for doc in docs)
    targets = tokens - len(docs)
    cut = sum(len(doc) > d.max_length for doc in docs)
    logger.info(
        "corpus: %d documents (%d empty skipped), %d tokens, %d targets -> %d rows of %d (%s, %s), %d documents "
        "longer than a row cut into pieces, %.1f%% of each row filled",
        len(docs),
        skipped,
        tokens,
        targets,
        len(rows),
        d.max_length,
        d.corpus_layout,
        "attention across documents" if d.cross_document_attention else "positions restart per document",
        cut,
        100 * float(dataset.row_lengths.mean()) / d.max_length,
    )
    per_step = examples_per_step(session)
    if len(dataset) < per_step:
        raise ConfigError(
            f"one optimizer step needs {per_step} rows of max_length={d.max_length} but the corpus makes "
            f"{len(dataset)}; lower max_length, the batch size or the accumulation"
        )
    stream, steps_per_epoch, total = sampled_stream(session, dataset, collator)
    logger.info("training %d steps (%d per epoch), %d rows per step", total, steps_per_epoch, per_step)
    return TrainData(
        stream=stream,
        collator=collator,
        eval_set=eval_set,
        steps_per_epoch=steps_per_epoch,
        total_steps=total,
        examples_per_step=per_step,
    )


def _streamed(session: Session, tokenizer: Any, collator: Any) -> TrainData:
    from datasets.distributed import split_dataset_by_node

    cfg = session.cfg
    d, t = cfg.data, cfg.train
    if t.max_steps <= 0:
        raise ConfigError("streaming=true needs max_steps (a stream has no known length to count epochs in)")
    sources = d.sources()
    streams = [stream_source(s, text_unit=d.text_unit) for s in sources]
    if len(streams) == 1:
        documents = streams[0]
    else:  # a weighted mixture: documents drawn from each source with probability proportional to its weight
        total = sum(s.weight for s in sources)
        documents = datasets.interleave_datasets(
            streams,
            probabilities=[s.weight / total for s in sources],
            seed=t.seed,
            stopping_strategy="all_exhausted",
        )
    documents = split_dataset_by_node(documents, rank=session.data_rank, world_size=session.data_world)
    rows = StreamingRows(
        documents,
        tokenizer,
        d.max_length,
        text_column=d.text_column,
        cross_document_attention=d.cross_document_attention,
    )
    per_step = examples_per_step(session)
    logger.info(
        "corpus: streamed from %s, each rank its own slice, rows of %d (concat), %d steps, %d rows per step",
        ", ".join(s.describe() for s in sources),
        d.max_length,
        t.max_steps,
        per_step,
    )
    stream = StreamingBatches(rows, collator, t.per_device_train_batch_size)
    if d.eval_split_fraction > 0:
        raise ConfigError(
            "streaming=true cannot hold documents out of a stream (eval_split_fraction); give a separate "
            "eval_dataset_name"
        )
    eval_set = None
    eval_source = d.eval_source()
    if eval_source is not None:  # read whole (an eval set is small), cut into rows like the training stream
        held, _, _ = rank0_first(
            lambda: _documents(
                eval_source,
                tokenizer,
                text_column=d.text_column,
                text_unit=d.text_unit,
                on_bad_record=d.on_bad_record,
                seed=t.seed,
                salt=len(sources),
            )
        )
        eval_set = RowsDataset(
            concat_rows(held, d.max_length, cross_document_attention=d.cross_document_attention)
        )
    return TrainData(
        stream=stream,  # type: ignore[arg-type]
        collator=collator,
        eval_set=eval_set,
        steps_per_epoch=0,
        total_steps=t.max_steps,
        examples_per_step=per_step,
    )
