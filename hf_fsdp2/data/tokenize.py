"""Tokenizing records into ``input_ids`` and ``labels`` with loss masks (cached by ``datasets``).

Every example comes out as ``input_ids`` and ``labels`` of the same length, plus ``length`` and
``num_targets``. ``labels`` are aligned with ``input_ids`` (not shifted): the loss shifts them, so
``labels[0]`` never contributes. ``IGNORE_INDEX`` (-100) marks tokens without loss.

Chat loss masks come from rendering prefixes of the conversation with the chat template and diffing
their tokens, so they are right for any template (no ``{% generation %}`` markers needed) and include
the end-of-turn token the model must learn to emit. Nothing is dropped silently: every truncated,
dropped or skipped record is counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import datasets
import numpy as np
from datasets.fingerprint import Hasher
from transformers import PreTrainedTokenizerBase

from hf_fsdp2.data.records import (
    _FORMAT_COLUMNS,
    BAD_RECORD_POLICIES,
    CHAT_LOSSES,
    DATASET_FORMATS,
    LONG_EXAMPLE_POLICIES,
    RecordError,
    _Chat,
    _normalise_record,
    _Plain,
    _record_error,
    detect_format,
)
from hf_fsdp2.labels import IGNORE_INDEX

if TYPE_CHECKING:
    pass


# Bump when tokenization changes, so that caches written by older code are not reused.
_PIPELINE_VERSION = 2

# Bookkeeping columns written by the tokenizing map and removed after it.
_OK, _TRUNCATED, _DROPPED_LONG, _BAD = 0, 1, 2, 3
_BOOKKEEPING = ["_status", "_reason", "_message"]
# Declared rather than inferred: a batch of only skipped records would otherwise infer list<null>.
_TOKENIZED_FEATURES = datasets.Features(
    {
        "input_ids": datasets.List(datasets.Value("int32")),
        "labels": datasets.List(datasets.Value("int32")),
        "length": datasets.Value("int32"),
        "num_targets": datasets.Value("int32"),
        "_status": datasets.Value("int8"),
        "_reason": datasets.Value("string"),
        "_message": datasets.Value("string"),
    }
)


@dataclass(frozen=True)
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


def _leading_special_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids the tokenizer puts before the text when adding special tokens (usually just BOS).

    Found by encoding a probe with and without special tokens rather than trusting ``bos_token_id``:
    some tokenizers define a BOS they never add (Qwen), others add one without naming it.
    """
    probe = "a"
    plain = tokenizer.encode(probe, add_special_tokens=False)
    special = tokenizer.encode(probe, add_special_tokens=True)
    for start in range(len(special) - len(plain) + 1):
        if special[start : start + len(plain)] == plain:
            return list(special[:start])
    return []


def _eos_id(tokenizer: PreTrainedTokenizerBase) -> int:
    eos = tokenizer.eos_token_id
    if not isinstance(eos, int):
        raise ValueError(
            f"The tokenizer has no eos_token (eos_token_id={eos!r}), needed to end 'text' and "
            "'prompt_completion' examples. Set tokenizer.eos_token to the model's end-of-sequence token."
        )
    return eos


def _special_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids = set(tokenizer.all_special_ids)
    # Chat markers such as <|eot_id|> are often added tokens flagged special without being in the
    # special-token attributes, so all_special_ids alone misses them.
    ids.update(i for i, token in tokenizer.added_tokens_decoder.items() if token.special)
    return frozenset(ids)


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


def _trim_after_end_of_turn(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], start: int, end: int, special_ids: frozenset[int]
) -> int:
    """Return the new end of the target span ``ids[start:end]``, without whitespace after end-of-turn.

    ChatML renders ``<|im_end|>\\n`` after every turn. Generation stops at ``<|im_end|>``, so the newline
    is never sampled by the model; it is template glue that the next turn's context already contains.
    The span therefore ends at its last special token when only whitespace follows it. Without a special
    token in the span (templates with a plain-text end marker) nothing is trimmed, so the model still
    learns whatever the template uses to end a turn.
    """
    last_special = next((i for i in range(end - 1, start - 1, -1) if ids[i] in special_ids), None)
    if last_special is None or last_special == end - 1:
        return end
    trailing = tokenizer.decode(ids[last_special + 1 : end])
    if not isinstance(trailing, str) or trailing.strip():
        return end
    return last_special + 1


class _Tokenizer:
    """The per-batch function of `tokenize_dataset`'s map (a class so that num_proc workers can pickle it).

    Each record becomes the strings it needs encoded (a conversation: its full render plus, for each
    trained assistant turn, the renders before and through that turn); the strings of the whole batch
    are encoded in one tokenizer call, then every record's ids and labels are assembled.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        dataset_format: str,
        max_length: int,
        chat_loss: str,
        completion_only_loss: bool,
        long_examples: str,
        on_bad_record: str,
        source: str,
    ) -> None:
        self.tokenizer = tokenizer
        self.dataset_format = dataset_format
        self.max_length = max_length
        self.chat_loss = chat_loss
        self.completion_only_loss = completion_only_loss
        self.long_examples = long_examples
        self.on_bad_record = on_bad_record
        self.source = source
        chat = dataset_format in ("messages", "conversations", "alpaca", "prompt_completion")
        if dataset_format in ("messages", "conversations", "alpaca") and tokenizer.chat_template is None:
            raise ValueError(
                f"{source or 'The dataset'} holds {dataset_format!r} records, rendered with the tokenizer's chat "
                "template, but the tokenizer has no chat_template. Use the tokenizer of an instruct model, or "
                "set tokenizer.chat_template."
            )
        # Resolved once, outside the per-record code, so a missing EOS fails before any record.
        self.eos = _eos_id(tokenizer) if dataset_format in ("prompt_completion", "text") else None
        self.leading = _leading_special_ids(tokenizer) if self.eos is not None else []
        self.special_ids = _special_ids(tokenizer) if chat else frozenset()

    def _render(
        self, turns: list[dict[str, str]], generation_prompt: bool, record: Mapping[str, Any], index: int
    ) -> str:
        if self.tokenizer.chat_template is None:
            raise ValueError(
                f"{self.source or 'The dataset'} has conversational prompt/completion records but the tokenizer "
                "has no chat_template; set tokenizer.chat_template."
            )
        try:
            rendered = self.tokenizer.apply_chat_template(
                turns, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as err:
            # Templates reject conversations with raise_exception (e.g. "roles must alternate"); the
            # bare message would not say which record.
            raise _record_error(
                self.source,
                index,
                list(record),
                f"the chat template failed on this conversation: {err}",
                "Fix or drop the record, or use a template that accepts it.",
                "chat template error",
            ) from err
        assert isinstance(rendered, str), type(rendered)
        return rendered

    def _strings(self, item: _Chat | _Plain, record: Mapping[str, Any], index: int) -> list[str]:
        if isinstance(item, _Plain):
            return [item.prompt, item.completion]
        strings = [self._render(item.messages, False, record, index)]
        for turn in item.trained or []:
            strings.append(self._render(item.messages[:turn], True, record, index))
            strings.append(self._render(item.messages[: turn + 1], False, record, index))
        return strings

    def _assemble(
        self, item: _Chat | _Plain, encoded: list[list[int]], record: Mapping[str, Any], index: int
    ) -> tuple[list[int], list[int]]:
        if isinstance(item, _Plain):
            assert self.eos is not None
            prompt_ids = self.leading + encoded[0] if item.prompt else self.leading
            completion_ids = encoded[1] + [self.eos]
            prompt_labels = prompt_ids if item.train_prompt else [IGNORE_INDEX] * len(prompt_ids)
            return prompt_ids + completion_ids, prompt_labels + completion_ids
        input_ids = encoded[0]
        if item.trained is None:
            return input_ids, list(input_ids)
        labels = [IGNORE_INDEX] * len(input_ids)
        for k, turn in enumerate(item.trained):
            before, through = encoded[1 + 2 * k], encoded[2 + 2 * k]
            for name, prefix in (("prompt before", before), ("conversation through", through)):
                if input_ids[: len(prefix)] != prefix:
                    raise _record_error(
                        self.source,
                        index,
                        list(record),
                        f"the chat template's render of the {name} assistant turn {turn} does not tokenize to a "
                        "prefix of the whole conversation, so assistant tokens cannot be located",
                        "Use a chat template that renders earlier turns identically whatever follows, or set "
                        "chat_loss=all (assistant_only_loss=false).",
                        "chat template not prefix-stable",
                    )
            end = _trim_after_end_of_turn(
                self.tokenizer, input_ids, len(before), len(through), self.special_ids
            )
            if end <= len(before):
                raise _record_error(
                    self.source,
                    index,
                    list(record),
                    f"assistant turn {turn} rendered to no tokens with this chat template",
                    "Check that the chat template renders assistant content.",
                    "empty assistant turn",
                )
            labels[len(before) : end] = input_ids[len(before) : end]
        return input_ids, labels

    def __call__(self, batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        columns = list(batch)
        records = [{c: batch[c][j] for c in columns} for j in range(len(indices))]
        items: list[_Chat | _Plain | RecordError] = []
        strings: list[str] = []
        spans: list[tuple[int, int]] = []
        for record, index in zip(records, indices, strict=True):
            try:
                normalised = _normalise_record(
                    record,
                    self.dataset_format,
                    chat_loss=self.chat_loss,
                    completion_only_loss=self.completion_only_loss,
                    source=self.source,
                    index=index,
                )
                record_strings = self._strings(normalised, record, index)
                items.append(normalised)
            except RecordError as err:
                if self.on_bad_record == "error":
                    raise
                items.append(err)  # kept to be counted once the batch is assembled
                record_strings = []
            spans.append((len(strings), len(strings) + len(record_strings)))
            strings.extend(record_strings)
        encoded = self.tokenizer(strings, add_special_tokens=False)["input_ids"] if strings else []

        out: dict[str, list[Any]] = {
            name: [] for name in ("input_ids", "labels", "length", "num_targets", *_BOOKKEEPING)
        }
        for record, index, item, (start, stop) in zip(records, indices, items, spans, strict=True):
            status, reason, message = _OK, "", ""
            input_ids: list[int] = []
            labels: list[int] = []
            try:
                if isinstance(item, RecordError):
                    raise item
                input_ids, labels = self._assemble(
                    item, [list(ids) for ids in encoded[start:stop]], record, index
                )
                if len(input_ids) > self.max_length:
                    if self.long_examples == "error":
                        raise _record_error(
                            self.source,
                            index,
                            list(record),
                            f"the example is {len(input_ids)} tokens long, more than max_length={self.max_length}",
                            "Raise max_length, or set long_examples=truncate or long_examples=drop.",
                            "longer than max_length",
                        )
                    status = _DROPPED_LONG if self.long_examples == "drop" else _TRUNCATED
                    input_ids, labels = input_ids[: self.max_length], labels[: self.max_length]
            except RecordError as err:
                if self.on_bad_record == "error":
                    raise
                status, reason, message, input_ids, labels = _BAD, err.reason, str(err), [], []
            if status == _DROPPED_LONG:
                input_ids, labels = [], []
            out["input_ids"].append(input_ids)
            out["labels"].append(labels)
            out["length"].append(len(input_ids))
            # labels[0] is never predicted (nothing precedes it), so it does not count as a target.
            out["num_targets"].append(sum(label != IGNORE_INDEX for label in labels[1:]))
            out["_status"].append(status)
            out["_reason"].append(reason)
            out["_message"].append(message)
        return out


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
) -> tuple[datasets.Dataset, TokenizeStats]:
    """Tokenize records into ``input_ids`` and ``labels`` (``IGNORE_INDEX`` where there is no loss).

    * Chats (``messages``, ``conversations``, ``alpaca``, conversational ``prompt_completion``):
      rendered with ``tokenizer.apply_chat_template`` and tokenized without adding special tokens (the
      template decides BOS). ``chat_loss="assistant"`` trains on every assistant turn,
      ``"last_assistant"`` on the last one only, ``"all"`` on every token. A trained turn includes the
      template's end-of-turn token (e.g. ``<|im_end|>``, which the model must learn to emit) but not
      whitespace the template puts after it. Conversational prompt/completion trains on the assistant
      turns of the completion (or every token without ``completion_only_loss``).
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
    function = _Tokenizer(
        tokenizer,
        dataset_format=dataset_format,
        max_length=max_length,
        chat_loss=chat_loss,
        completion_only_loss=completion_only_loss,
        long_examples=long_examples,
        on_bad_record=on_bad_record,
        source=source,
    )
    settings = [
        dataset_format,
        max_length,
        chat_loss,
        completion_only_loss,
        long_examples,
        on_bad_record,
        source,
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
        features=_TOKENIZED_FEATURES,
        new_fingerprint=fingerprint,
        load_from_cache_file=True,
        desc=f"Tokenizing {source}" if source else "Tokenizing",
    )
    assert tokenized._indices is None  # a map writes a fresh table, so its columns are read directly
    status = tokenized.data.column("_status").to_numpy()
    num_targets = tokenized.data.column("num_targets").to_numpy()
    bad = np.flatnonzero(status == _BAD)
    reasons = tokenized.select(bad)["_reason"][:] if len(bad) else []
    examples = tuple(tokenized.select(bad[:3])["_message"][:]) if len(bad) else ()
    keep_mask = (status == _OK) | (status == _TRUNCATED)
    kept = tokenized
    if not keep_mask.all():
        kept = tokenized.select(np.flatnonzero(keep_mask))
    stats = TokenizeStats(
        source=source,
        dataset_format=dataset_format,
        num_records=len(tokenized),
        num_kept=int(keep_mask.sum()),
        num_truncated=int((status == _TRUNCATED).sum()),
        num_dropped_long=int((status == _DROPPED_LONG).sum()),
        num_without_targets=int(((num_targets == 0) & keep_mask).sum()),
        skipped=dict(Counter(reasons)),
        skipped_examples=examples,
    )
    return kept.remove_columns(_BOOKKEEPING), stats
