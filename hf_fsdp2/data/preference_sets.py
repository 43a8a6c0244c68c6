"""Preference sources -> the training and eval sets of tokenized pairs (DPO, reward models) or unpaired examples
(KTO): the weighted mixture, the eval split carved out first, each record's position as its ``index``; and doctor's
reading of the first records of each source as a run tokenizes them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from hf_fsdp2.config.sections import DataArgs
from hf_fsdp2.config.sources import DataSource, parse_column_mapping
from hf_fsdp2.data.loading import apply_column_mapping, load_source
from hf_fsdp2.data.mixture import _weighted_indices
from hf_fsdp2.data.pairs import PreferenceStats, tokenize_pairs
from hf_fsdp2.data.unpaired import tokenize_unpaired

logger = logging.getLogger("hf_fsdp2")


class PairList(list):  # type: ignore[type-arg]
    """Tokenized pairs, indexable like a dataset (each pair's ``index`` is its position)."""


def _tokenized(
    source: DataSource, d: DataArgs, tokenizer: Any, unpaired: bool = False
) -> tuple[list[dict[str, Any]], PreferenceStats]:
    raw = load_source(source, on_bad_record=d.on_bad_record)
    mapping = parse_column_mapping(d.dataset_column_mapping)
    if mapping:
        raw = apply_column_mapping(raw, mapping, source.describe())
    missing = [c for c in ("chosen", "rejected") if c not in raw.column_names]
    if unpaired and missing:
        missing = [c for c in ("prompt", "completion", "label") if c not in raw.column_names]
    if missing:
        raise ValueError(
            f"{source.describe()}: preference data needs 'chosen' and 'rejected' columns (and optionally 'prompt')"
            + (", or unpaired 'prompt', 'completion' and 'label'" if unpaired else "")
            + f"; missing {missing} (columns: {raw.column_names}); rename them with dataset_column_mapping"
        )
    tokenize = tokenize_unpaired if unpaired else tokenize_pairs
    return tokenize(
        raw,
        tokenizer,
        max_length=d.max_length,
        long_examples=d.long_examples,
        on_bad_record=d.on_bad_record,
        source=source.describe(),
    )


def _reindexed(pairs: list[dict[str, Any]]) -> PairList:
    return PairList({**pair, "index": i} for i, pair in enumerate(pairs))


def load_pairs(
    d: DataArgs, seed: int, tokenizer: Any, unpaired: bool = False
) -> tuple[PairList, PairList | None]:
    """The training pairs (weighted mixture, eval carved out first) and the eval pairs (or None) of the data section
    ``d``, shuffled and weighted from ``seed``; ``unpaired``: KTO's examples
    (:func:`~hf_fsdp2.data.unpaired.tokenize_unpaired`) instead.

    Raises:
        ValueError / ConfigError / FileNotFoundError: bad data or settings, naming the source and record.
    """
    train: list[dict[str, Any]] = []
    held_out: list[dict[str, Any]] = []
    for salt, source in enumerate(d.sources()):
        pairs, stats = _tokenized(source, d, tokenizer, unpaired)
        logger.info(stats.describe(source.describe()))
        if not pairs:
            raise ValueError(f"{source.describe()}: no pair left to train on; see the counts above")
        if d.eval_split_fraction > 0:
            n_eval = round(d.eval_split_fraction * len(pairs))
            if n_eval >= len(pairs):
                raise ValueError(
                    f"eval_split_fraction={d.eval_split_fraction} holds out all {len(pairs)} pairs of "
                    f"{source.describe()}; lower it"
                )
            order = np.random.default_rng([seed, salt, 1]).permutation(len(pairs))
            held_out.extend(pairs[i] for i in np.sort(order[:n_eval]))
            pairs = [pairs[i] for i in np.sort(order[n_eval:])]
        train.extend(pairs[i] for i in _weighted_indices(len(pairs), source.weight, seed, salt))
    eval_pairs: list[dict[str, Any]] | None = held_out or None
    eval_source = d.eval_source()
    if eval_source is not None:
        eval_pairs, stats = _tokenized(eval_source, d, tokenizer, unpaired)
        logger.info(stats.describe(eval_source.describe()))
        if not eval_pairs:
            raise ValueError(f"{eval_source.describe()}: no eval pair left; see the counts above")
    return _reindexed(train), _reindexed(eval_pairs) if eval_pairs else None


def preview_tokenized(
    cfg: Any,
    tokenizer: Any,
    load: Callable[[DataSource], Any],
    read: int,
    tokenize: Callable[..., Any],
    kind: str,
) -> list[tuple[str, str]]:
    """Doctor's reading: each source's first ``read`` records through ``tokenize`` (the pair tokenizers' signature), as
    the run reads them (the run's error raised); ``kind`` names what they are."""
    d = cfg.data
    out = []
    for source in d.sources():
        rows, _ = tokenize(
            load(source),
            tokenizer,
            max_length=d.max_length,
            long_examples=d.long_examples,
            on_bad_record=d.on_bad_record,
            source=source.describe(),
        )
        out.append((source.describe(), f"{kind}, {len(rows)} of the first {read} records tokenized"))
    return out


def preview_pairs(
    cfg: Any, tokenizer: Any, load: Callable[[DataSource], Any], read: int
) -> list[tuple[str, str]]:
    """Doctor's reading: each source's first ``read`` records tokenized as preference pairs."""
    return preview_tokenized(cfg, tokenizer, load, read, tokenize_pairs, "preference pairs")


def preview_unpaired(
    cfg: Any, tokenizer: Any, load: Callable[[DataSource], Any], read: int
) -> list[tuple[str, str]]:
    """Doctor's reading: each source's first ``read`` records tokenized as unpaired examples."""
    return preview_tokenized(cfg, tokenizer, load, read, tokenize_unpaired, "unpaired examples")
