"""Tokenizing a dataset into ``input_ids`` and ``labels`` with loss masks (cached by ``datasets``).

Every example comes out as ``input_ids`` and ``labels`` of the same length, plus ``length`` and
``num_targets``. ``labels`` are aligned with ``input_ids`` (not shifted): the loss shifts them, so
``labels[0]`` never contributes. ``IGNORE_INDEX`` (-100) marks tokens without loss.

This file is the dataset level: options checked, the map (`hf_fsdp2.data.encode.BatchTokenizer`, whose
chat masks come from `hf_fsdp2.data.chat_mask`) run and cached under a fingerprint of the data, the
tokenizer and the settings, then counted. Nothing is dropped silently: every truncated, dropped or
skipped record is counted in `TokenizeStats`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import numpy as np
from datasets.fingerprint import Hasher
from transformers import PreTrainedTokenizerBase

from hf_fsdp2.data.encode import (
    BAD,
    BOOKKEEPING,
    DROPPED_LONG,
    OK,
    TOKENIZED_FEATURES,
    TRUNCATED,
    BatchTokenizer,
)
from hf_fsdp2.data.images import check_image_format, image_column
from hf_fsdp2.data.records import (
    _FORMAT_COLUMNS,
    BAD_RECORD_POLICIES,
    CHAT_LOSSES,
    DATASET_FORMATS,
    LONG_EXAMPLE_POLICIES,
    detect_format,
)
from hf_fsdp2.data.tool_calls import ToolDataError, parse_tools
from hf_fsdp2.data.vision_encode import VISION_FEATURES, VisionBatchTokenizer, processor_fingerprint

# Bump when tokenization changes, so that caches written by older code are not reused.
_PIPELINE_VERSION = 3


@dataclass(frozen=True, kw_only=True)
class TokenizeStats:
    """What `tokenize_dataset` did to one source, so that nothing is dropped or cut silently.

    Attributes:
        source: Name of the source.
        dataset_format: The record format used.
        num_records: Records read.
        num_kept: Examples produced (records minus dropped and skipped ones).
        num_truncated: Kept examples longer than ``max_length`` that were right-truncated.
        num_dropped_long: Records longer than ``max_length`` dropped (``long_examples="drop"``).
        num_without_targets: Kept examples with no target token (they add no loss). ``labels[0]`` is
            not counted as a target: no token precedes it, so it is never predicted.
        skipped: Bad records skipped (``on_bad_record="skip"``), by reason.
        skipped_examples: The messages of the first few skipped records.
    """

    source: str
    dataset_format: str
    num_records: int
    num_kept: int
    num_truncated: int = 0
    num_dropped_long: int = 0
    num_without_targets: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    skipped_examples: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line for the data summary."""
        parts = [f"{self.num_records} records ({self.dataset_format})"]
        skipped = sum(self.skipped.values())
        if skipped:
            reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items()))
            parts.append(f"{skipped} bad records skipped ({reasons})")
        parts.append(f"{self.num_truncated} truncated")
        parts.append(f"{self.num_dropped_long} dropped as longer than max_length")
        parts.append(f"{self.num_without_targets} without any target token (kept, no loss)")
        return f"{self.source}: " + ", ".join(parts) + f" -> {self.num_kept} examples"


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A hash of what decides how the tokenizer encodes text: vocabulary, merges, normalizer, special
    tokens and chat template; the same for a tokenizer loaded again in another process.

    Transient settings (truncation, padding) are left out: they change when the tokenizer is called.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        if backend.truncation is not None or backend.padding is not None:
            # Serialise a copy without them (rare: the pipeline never calls with truncation or padding).
            backend = type(backend).from_str(backend.to_str())
            backend.no_truncation()
            backend.no_padding()
        model_state: Any = backend.to_str()
    else:
        model_state = sorted(tokenizer.get_vocab().items())
    added = sorted((i, str(t), t.special) for i, t in tokenizer.added_tokens_decoder.items())
    return str(
        Hasher.hash(
            [
                type(tokenizer).__name__,
                model_state,
                added,
                tokenizer.chat_template,
                sorted(tokenizer.special_tokens_map.items()),
            ]
        )
    )


def tokenize_dataset(
    dataset: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_length: int,
    dataset_format: str = "auto",
    chat_loss: str = "assistant",
    completion_only_loss: bool = True,
    long_examples: str = "truncate",
    on_bad_record: str = "error",
    source: str = "",
    num_proc: int | None = None,
    tools: list[dict[str, Any]] | str | None = None,
    processor: Any = None,
    image_root: Path | None = None,
) -> tuple[datasets.Dataset, TokenizeStats]:
    """Tokenize records into ``input_ids`` and ``labels`` (``IGNORE_INDEX`` where there is no loss).

    * Chats (``messages``, ``conversations``, ``alpaca``, conversational ``prompt_completion``):
      rendered with ``tokenizer.apply_chat_template`` and tokenized without adding special tokens (the
      template decides BOS). ``chat_loss="assistant"`` trains on every assistant turn,
      ``"last_assistant"`` on the last one only, ``"all"`` on every token. A trained turn includes the
      template's end-of-turn token (e.g. ``<|im_end|>``, which the model must learn to emit) but not
      whitespace the template puts after it. Conversational prompt/completion trains on the assistant
      turns of the completion (or every token without ``completion_only_loss``). Tool-calling chats
      (`hf_fsdp2.data.tool_calls`): the template receives the record's ``tools`` (else ``tools``); assistant
      ``tool_calls`` are trained like the assistant's text, ``tool`` results are not.
    * ``prompt_completion`` strings: ``[bos] + tokens(prompt) + tokens(completion) + [eos]``, BOS only if
      the tokenizer adds one by default. Prompt and completion are tokenized separately so their
      boundary is a token boundary. With ``completion_only_loss`` only completion and EOS are targets.
    * ``text``: ``[bos] + tokens(text) + [eos]``, all targets.

    The map is batched, runs on ``num_proc`` processes and is cached: its fingerprint is derived from
    the raw dataset's fingerprint, `tokenizer_fingerprint` and every setting here, so a second run (or
    another rank, once the first has finished) loads the result instead of tokenizing again. In-memory
    datasets have nowhere to cache and are always tokenized.

    Args:
        dataset: Untokenized dataset, e.g. from `load_raw_dataset`.
        tokenizer: Tokenizer of the model; needs a chat template for chats and an EOS token otherwise.
        max_length: Maximum tokens per example.
        dataset_format: ``"auto"`` (see `detect_format`) or one of ``DATASET_FORMATS``.
        chat_loss: One of ``CHAT_LOSSES``.
        completion_only_loss: ``prompt_completion`` only: loss on the completion only (else every token).
        long_examples: Examples longer than ``max_length``: ``"truncate"`` (right), ``"drop"``, or
            ``"error"`` (a bad record).
        on_bad_record: ``"error"`` raises on the first bad record; ``"skip"`` skips and counts them.
        source: Name of the dataset used in messages (e.g. its path).
        num_proc: Processes for the map (None: this process).
        tools: Tool schemas (a list or its JSON string) for the chat records without a ``tools`` column value.
        processor: The model's processor (a vision-language composite's), for a dataset with images.
        image_root: The folder relative image paths are read from (the data file's).

    Returns:
        The tokenized dataset (columns ``input_ids``, ``labels``, ``length``, ``num_targets``) and its
        `TokenizeStats`.

    Raises:
        ValueError: A bad option, missing columns, a tokenizer without chat template / EOS, or (with
            ``on_bad_record="error"``) a `RecordError` naming the source, record index and problem.
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}.")
    for name, value, allowed in (
        ("chat_loss", chat_loss, CHAT_LOSSES),
        ("long_examples", long_examples, LONG_EXAMPLE_POLICIES),
        ("on_bad_record", on_bad_record, BAD_RECORD_POLICIES),
    ):
        if value not in allowed:
            raise ValueError(f"Unknown {name} {value!r}; choose one of {list(allowed)}.")
    columns = list(dataset.column_names)
    if dataset_format == "auto":
        dataset_format = detect_format(columns)
    elif dataset_format not in DATASET_FORMATS:
        raise ValueError(
            f"Unknown dataset_format {dataset_format!r}; choose 'auto' or one of {list(DATASET_FORMATS)}."
        )
    missing = [c for c in _FORMAT_COLUMNS[dataset_format] if c not in columns]
    if missing:
        raise ValueError(
            f"dataset_format={dataset_format!r} needs columns {list(_FORMAT_COLUMNS[dataset_format])} but "
            f"{source or 'the dataset'} lacks {missing} (columns found: {columns}). Rename the columns with "
            "dataset_column_mapping or set dataset_format='auto'."
        )
    try:
        default_tools = parse_tools(tools)
    except ToolDataError as err:
        raise ValueError(f"The tools given for {source or 'the dataset'}: {err}.") from err
    function: BatchTokenizer | VisionBatchTokenizer = BatchTokenizer(
        tokenizer,
        dataset_format=dataset_format,
        max_length=max_length,
        chat_loss=chat_loss,
        completion_only_loss=completion_only_loss,
        long_examples=long_examples,
        on_bad_record=on_bad_record,
        source=source,
        tools=default_tools,
    )
    features, vision = TOKENIZED_FEATURES, ""
    if image_column(columns) is not None:
        check_image_format(dataset_format, columns, source)
        if processor is None:
            raise ValueError(
                f"{source or 'The dataset'} has an image column ({image_column(columns)!r}) but the model is not a "
                "vision-language checkpoint (no processor builds image inputs for it): train a vision-language "
                "composite (docs/vlm.md lists them), or drop the column for a text run"
            )
        function = VisionBatchTokenizer(
            processor,
            max_length=max_length,
            chat_loss=chat_loss,
            long_examples=long_examples,
            on_bad_record=on_bad_record,
            source=source,
            image_root=image_root,
        )
        features, vision = VISION_FEATURES, processor_fingerprint(processor) + str(image_root)
    settings = [
        dataset_format,
        max_length,
        chat_loss,
        completion_only_loss,
        long_examples,
        on_bad_record,
        source,
        default_tools,
        *([vision] if vision else []),
    ]
    fingerprint = Hasher.hash(
        [_PIPELINE_VERSION, dataset._fingerprint, tokenizer_fingerprint(tokenizer), settings]
    )
    tokenized = dataset.map(
        function,
        batched=True,
        with_indices=True,
        remove_columns=columns,
        num_proc=num_proc,
        features=features,
        new_fingerprint=fingerprint,
        load_from_cache_file=True,
        desc=f"Tokenizing {source}" if source else "Tokenizing",
    )
    assert tokenized._indices is None  # a map writes a fresh table, so its columns are read directly
    status = tokenized.data.column("_status").to_numpy()
    num_targets = tokenized.data.column("num_targets").to_numpy()
    bad = np.flatnonzero(status == BAD)
    reasons = tokenized.select(bad)["_reason"][:] if len(bad) else []
    examples = tuple(tokenized.select(bad[:3])["_message"][:]) if len(bad) else ()
    keep_mask = (status == OK) | (status == TRUNCATED)
    kept = tokenized
    if not keep_mask.all():
        kept = tokenized.select(np.flatnonzero(keep_mask))
    stats = TokenizeStats(
        source=source,
        dataset_format=dataset_format,
        num_records=len(tokenized),
        num_kept=int(keep_mask.sum()),
        num_truncated=int((status == TRUNCATED).sum()),
        num_dropped_long=int((status == DROPPED_LONG).sum()),
        num_without_targets=int(((num_targets == 0) & keep_mask).sum()),
        skipped=dict(Counter(reasons)),
        skipped_examples=examples,
    )
    return kept.remove_columns(BOOKKEEPING), stats
