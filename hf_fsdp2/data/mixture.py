"""Sources -> the training mixture and the eval set, with the summary a recipe logs; showing what the
model learns.

The pipeline a recipe runs, top to bottom::

    sources = resolve_sources(dataset_name="data/train.jsonl")            # or a weighted mixture
    data = build_sft_datasets(sources, tokenizer, max_length=2048, seed=0)  # tokenized, cached, summarised
    sampler = ShardedSampler(len(data.train), rank=rank, world_size=world_size, seed=seed)
    loader = build_dataloader(data.train, batch_size=8, collator=PaddingCollator(pad_id), sampler=sampler)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import datasets
import numpy as np
from transformers import PreTrainedTokenizerBase

from hf_fsdp2.config.sources import DataSource, parse_column_mapping, parse_source, resolve_sources
from hf_fsdp2.data.images import image_column, image_root
from hf_fsdp2.data.loading import apply_column_mapping, load_source
from hf_fsdp2.data.tokenize import TokenizeStats, tokenize_dataset
from hf_fsdp2.data.tool_calls import read_tools_option
from hf_fsdp2.labels import IGNORE_INDEX

if TYPE_CHECKING:
    from hf_fsdp2.config import DataArgs


@dataclass(frozen=True, kw_only=True)
class SFTData:
    """The tokenized training and evaluation sets and what it took to build them.

    Attributes:
        train: Tokenized training examples, the weighted mixture of the sources.
        eval: Tokenized evaluation examples, or None.
        stats: `TokenizeStats` of every training source, then of the eval source if any.
        train_counts: Examples each training source contributes to ``train`` (after weights).
        eval_description: Where the eval examples come from.
    """

    train: datasets.Dataset
    eval: datasets.Dataset | None
    stats: list[TokenizeStats]
    train_counts: list[int]
    eval_description: str = ""

    def summary_lines(self, max_length: int) -> list[str]:
        """Lines for the log: per source what was read, skipped, truncated, dropped and used."""
        lines = []
        for i, stats in enumerate(self.stats):
            used = (
                f"; {self.train_counts[i]} examples in the training mixture"
                if i < len(self.train_counts)
                else ""
            )
            lines.append(f"data source {stats.describe()}{used}")
            lines.extend(f"data skipped record example: {message}" for message in stats.skipped_examples)
        lines.append(
            f"data: {len(self.train)} training examples (max_length={max_length}), "
            + (
                f"{len(self.eval)} eval examples ({self.eval_description})"
                if self.eval is not None
                else "no eval set"
            )
        )
        return lines


def with_image_columns(parts: list[datasets.Dataset]) -> list[datasets.Dataset]:
    """``parts``, the text ones given the image columns (no render, no image) when another part has images, so a
    mixture of image and text sources concatenates; unchanged when none has."""
    if not any("images" in p.column_names for p in parts):
        return parts
    from hf_fsdp2.data.vision_encode import VISION_FEATURES

    out = []
    for part in parts:
        if "images" not in part.column_names:
            part = part.add_column("text", [""] * len(part)).add_column(
                "images", [[] for _ in range(len(part))]
            )
            part = part.cast(VISION_FEATURES)
        out.append(part)
    return out


def _weighted_indices(n: int, weight: float, seed: int, salt: int) -> np.ndarray:
    """``round(weight * n)`` indices of ``range(n)``: whole copies, then a seeded subset without repeats."""
    total = round(weight * n)
    whole, rest = divmod(total, n)
    rng = np.random.default_rng([seed, salt])
    extra = np.sort(rng.permutation(n)[:rest])
    return np.concatenate([np.tile(np.arange(n), whole), extra]).astype(np.int64)


def build_sft_datasets(
    sources: Sequence[DataSource],
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_length: int,
    seed: int,
    dataset_format: str = "auto",
    column_mapping: Mapping[str, str] | None = None,
    chat_loss: str = "assistant",
    completion_only_loss: bool = True,
    long_examples: str = "truncate",
    on_bad_record: str = "error",
    num_proc: int | None = None,
    tools: list[dict[str, Any]] | None = None,
    eval_source: DataSource | None = None,
    eval_split_fraction: float = 0.0,
    load: Callable[[DataSource], datasets.Dataset] = load_source,
    load_processor: Callable[[], Any] | None = None,
) -> SFTData:
    """Load, map columns, tokenize (cached) and mix the training sources; build the eval set.

    Each source is tokenized on its own (format detected per source, errors naming it). With
    ``eval_split_fraction`` a seeded fraction of every source's examples is held out for eval before
    the weights apply, so a record repeated by a weight > 1 never lands in both sets. Weights (see
    `DataSource`) then select each source's examples with a seed; the mixture is the concatenation
    (the sampler shuffles it).

    Args:
        sources: Training sources, e.g. from `resolve_sources`.
        tokenizer: The model's tokenizer.
        max_length: Maximum tokens per example.
        seed: Seed of the eval carve-out and of the weighted selection.
        dataset_format, chat_loss, completion_only_loss, long_examples, on_bad_record, num_proc: As in
            `tokenize_dataset`; the same for every source.
        column_mapping: Column renames applied to every source (see `apply_column_mapping`).
        tools: Tool schemas for the chat records without their own (``dataset_tools``).
        eval_source: A separate eval source (its weight is ignored), or None.
        eval_split_fraction: Fraction of the training examples held out for eval, in ``[0, 1)``.
        load: How a source is read (tests replace it).
        load_processor: Gives the model's processor, called for a source with images only (None: a text model; an
            image column is then refused).

    Returns:
        The `SFTData`.

    Raises:
        ValueError: Both eval options, a fraction outside ``[0, 1)``, a weight selecting no example, an
            eval carve-out leaving a source empty, or any error of the steps above.
    """
    if eval_source is not None and eval_split_fraction > 0:
        raise ValueError(
            "Give either eval_dataset_name (a separate eval source) or eval_split_fraction (carved from train), "
            "not both."
        )
    if not 0 <= eval_split_fraction < 1:
        raise ValueError(f"eval_split_fraction={eval_split_fraction} must be in [0, 1).")

    def tokenized(source: DataSource) -> tuple[datasets.Dataset, TokenizeStats]:
        bad_lines: list[str] = []
        loaded = (
            load(source)
            if load is not load_source
            else load_source(source, on_bad_record=on_bad_record, bad_lines=bad_lines)
        )
        raw = apply_column_mapping(loaded, column_mapping or {}, source.describe())
        examples, stats = tokenize_dataset(
            raw,
            tokenizer,
            max_length=max_length,
            dataset_format=dataset_format,
            chat_loss=chat_loss,
            completion_only_loss=completion_only_loss,
            long_examples=long_examples,
            on_bad_record=on_bad_record,
            source=source.describe(),
            num_proc=num_proc,
            tools=tools,
            processor=load_processor() if load_processor and image_column(raw.column_names) else None,
            image_root=image_root(source.name),
        )
        if bad_lines:  # lines that were not records at all: skipped before tokenizing, counted here
            skipped = dict(stats.skipped)
            skipped["unreadable line"] = skipped.get("unreadable line", 0) + len(bad_lines)
            stats = dataclasses.replace(
                stats,
                num_records=stats.num_records + len(bad_lines),
                skipped=skipped,
                skipped_examples=(*bad_lines[:3], *stats.skipped_examples)[:3],
            )
        return examples, stats

    parts, eval_parts, all_stats, counts = [], [], [], []
    for salt, source in enumerate(sources):
        examples, stats = tokenized(source)
        all_stats.append(stats)
        if len(examples) == 0:
            raise ValueError(f"{stats.describe()}: no example left to train on; see the counts above.")
        if eval_split_fraction > 0:
            n_eval = round(eval_split_fraction * len(examples))
            if n_eval >= len(examples):
                raise ValueError(
                    f"eval_split_fraction={eval_split_fraction} holds out all {len(examples)} examples of "
                    f"{source.describe()}; lower it."
                )
            order = np.random.default_rng([seed, salt, 1]).permutation(len(examples))
            eval_parts.append(examples.select(np.sort(order[:n_eval])))
            examples = examples.select(np.sort(order[n_eval:]))
        indices = _weighted_indices(len(examples), source.weight, seed, salt)
        if len(indices) == 0:
            raise ValueError(
                f"dataset_mixture weight {source.weight} of {source.describe()} selects none of its "
                f"{len(examples)} examples; raise the weight."
            )
        counts.append(len(indices))
        is_identity = len(indices) == len(examples) and bool((indices == np.arange(len(examples))).all())
        parts.append(examples if is_identity else examples.select(indices))
    train = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(with_image_columns(parts))

    eval_set: datasets.Dataset | None = None
    description = ""
    if eval_source is not None:
        eval_set, eval_stats = tokenized(eval_source)
        all_stats.append(eval_stats)
        description = f"from {eval_source.describe()}"
    elif eval_split_fraction > 0:
        eval_set = (
            eval_parts[0]
            if len(eval_parts) == 1
            else datasets.concatenate_datasets(with_image_columns(eval_parts))
        )
        description = f"{eval_split_fraction:g} of each source held out from train, seed {seed}"
    if eval_set is not None and len(eval_set) == 0:
        raise ValueError(
            f"The eval set ({description}) has no example; raise eval_split_fraction or fix the source."
        )
    return SFTData(
        train=train, eval=eval_set, stats=all_stats, train_counts=counts, eval_description=description
    )


_GREEN, _RESET = "\x1b[42;30m", "\x1b[0m"


def build_sft_datasets_from_config(
    d: DataArgs,
    tokenizer: PreTrainedTokenizerBase,
    *,
    seed: int,
    load: Callable[[DataSource], datasets.Dataset] = load_source,
    load_processor: Callable[[], Any] | None = None,
) -> SFTData:
    """:func:`build_sft_datasets` with every setting taken from a recipe's data section (``load_processor``: gives
    the model's processor, for sources with images).

    The recipe and ``hf-fsdp2 show-data`` both call this, so what the latter shows is what trains.
    """
    return build_sft_datasets(
        resolve_sources(
            dataset_name=d.dataset_name,
            dataset_config_name=d.dataset_config_name,
            dataset_split=d.dataset_split,
            dataset_revision=d.dataset_revision,
            dataset_mixture=d.dataset_mixture,
        ),
        tokenizer,
        max_length=d.max_length,
        seed=seed,
        dataset_format=d.dataset_format,
        column_mapping=parse_column_mapping(d.dataset_column_mapping),
        chat_loss=d.resolved_chat_loss(),
        completion_only_loss=d.completion_only_loss,
        long_examples=d.long_examples,
        on_bad_record=d.on_bad_record,
        num_proc=d.dataset_num_proc,
        tools=read_tools_option(d.dataset_tools),
        eval_source=parse_source(d.eval_dataset_name, split=d.eval_dataset_split)
        if d.eval_dataset_name
        else None,
        eval_split_fraction=d.eval_split_fraction,
        load=load,
        load_processor=load_processor,
    )


def format_trained_spans(
    tokenizer: PreTrainedTokenizerBase, input_ids: Sequence[int], labels: Sequence[int], *, color: bool
) -> str:
    """Decode an example with its trained spans highlighted.

    Target tokens (the ones the model is trained to predict) are shown on a green background with
    ``color``, else between ``[[`` and ``]]``. ``labels[0]`` is never predicted and is shown untrained.

    Args:
        tokenizer: The tokenizer that produced the ids.
        input_ids: The example's token ids.
        labels: Its labels (``IGNORE_INDEX`` where there is no loss).
        color: ANSI colors (for a terminal) or bracket markers.

    Returns:
        The decoded text with markers.
    """
    trained = [i > 0 and label != IGNORE_INDEX for i, label in enumerate(labels)]
    runs: list[tuple[int, int, bool]] = []
    for i, flag in enumerate(trained):
        if runs and runs[-1][2] == flag:
            runs[-1] = (runs[-1][0], i + 1, flag)
        else:
            runs.append((i, i + 1, flag))
    # Decoding growing prefixes keeps the spacing a run would lose when decoded on its own (SentencePiece
    # drops the leading space of a decode).
    pieces: list[str] = []
    previous = ""
    for start, end, flag in runs:
        text = str(tokenizer.decode(list(input_ids[:end])))
        piece = (
            text[len(previous) :]
            if text.startswith(previous)
            else str(tokenizer.decode(list(input_ids[start:end])))
        )
        previous = text
        if flag:
            piece = f"{_GREEN}{piece}{_RESET}" if color else f"[[{piece}]]"
        pieces.append(piece)
    return "".join(pieces)


def preview_sft(cfg: Any, tokenizer: Any, load: Callable[[Any], Any], read: int) -> list[tuple[str, str]]:
    """Doctor's reading: the first ``read`` records of each source tokenized as the SFT and CPT recipes' builders do
    (``cfg``: the run's config)."""
    data = build_sft_datasets_from_config(cfg.data, tokenizer, seed=cfg.train.seed, load=load)
    return [
        (stats.source, f"{stats.dataset_format} records, {count} of the first {read} tokenized")
        for stats, count in zip(data.stats, data.train_counts, strict=False)
    ]
