"""Datasets -> tokenized examples with loss masks, padding collator, resumable sharded sampling.

The pipeline a recipe runs, top to bottom::

    raw = load_raw_dataset("data/train.jsonl")
    ds, stats = tokenize_dataset(raw, tokenizer, max_length=2048, source="data/train.jsonl")
    sampler = ShardedSampler(len(ds), rank=rank, world_size=world_size, seed=seed)
    loader = build_dataloader(ds, batch_size=8, collator=PaddingCollator(pad_id), sampler=sampler)

Three record formats are understood (see `detect_format`):

* ``messages``: a list of ``{"role", "content"}`` turns rendered with the tokenizer's chat template;
* ``prompt_completion``: two strings, loss on the completion;
* ``text``: one string, loss on every token.

Every example comes out as ``input_ids`` and ``labels`` of the same length. ``labels`` are aligned with
``input_ids`` (not shifted): the model shifts them, so ``labels[0]`` never contributes to the loss.
``IGNORE_INDEX`` (-100) marks tokens without loss.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import datasets
import pyarrow.parquet
import torch
from torch.utils.data import DataLoader, Sampler
from torch.utils.data import Dataset as TorchDataset
from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100
"""Label of tokens without loss: the default ``ignore_index`` of ``torch.nn.functional.cross_entropy``."""

DATASET_FORMATS = ("messages", "prompt_completion", "text")
"""Record formats in the order `detect_format` tries them."""

CHAT_ROLES = ("system", "user", "assistant")

# Local file suffix -> the `datasets` packaged builder that reads it. .json and .jsonl share a builder,
# so a folder may mix them; it may not mix JSON with Parquet.
_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}

# Columns each format needs: what `detect_format` looks for and `tokenize_dataset` checks.
_FORMAT_COLUMNS: dict[str, tuple[str, ...]] = {
    "messages": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
}


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def _looks_like_path(name_or_path: str) -> bool:
    """True when the user evidently meant a local path rather than a hub dataset id."""
    if os.path.exists(os.path.expanduser(name_or_path)):
        return True
    if name_or_path.startswith(("./", "../", "/", "~")):
        return True
    return name_or_path.endswith(tuple(_FILE_BUILDERS))


def _local_data_files(path: Path) -> tuple[str, list[str]]:
    """Return the builder name and the sorted data files of a local file or folder."""
    if path.is_file():
        builder = _FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ValueError(
                f"Unsupported dataset file type {path.suffix!r} for {str(path)!r}; "
                f"supported: {', '.join(_FILE_BUILDERS)}. Convert the file to JSON Lines or Parquet."
            )
        return builder, [str(path)]

    # Recursive so that a downloaded hub snapshot (data/train-00000-of-00002.parquet, ...) loads as is;
    # hidden entries are skipped because they are caches (.cache/huggingface) or VCS metadata.
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file()
        and p.suffix.lower() in _FILE_BUILDERS
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    if not files:
        raise FileNotFoundError(
            f"No data files found in folder {str(path)!r}: expected files ending in "
            f"{', '.join(_FILE_BUILDERS)}."
        )
    builders = {_FILE_BUILDERS[p.suffix.lower()] for p in files}
    if len(builders) > 1:
        suffixes = sorted({p.suffix.lower() for p in files})
        raise ValueError(
            f"Folder {str(path)!r} mixes data file types {suffixes}; a dataset folder must hold one type "
            "(JSON/JSON Lines or Parquet). Move the other files out or point at one file."
        )
    return builders.pop(), [str(p) for p in files]


def _has_records(path: str, builder: str) -> bool:
    """True when a data file holds at least one record; cheap (Parquet footer, first non-blank byte)."""
    if builder == "parquet":
        return bool(pyarrow.parquet.read_metadata(path).num_rows > 0)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return True
    return False


def load_raw_dataset(
    name_or_path: str,
    *,
    split: str = "train",
    config_name: str | None = None,
    revision: str | None = None,
) -> datasets.Dataset:
    """Load an untokenized dataset from a local file or folder, or from the hub.

    Local data: a ``.jsonl``, ``.json`` or ``.parquet`` file, or a folder holding files of one of those
    types (searched recursively, hidden entries skipped). The local files become the split named by
    ``split``, so slices such as ``"train[:1000]"`` work for local data too. Anything that does not look
    like a path is passed to ``datasets.load_dataset`` as a hub dataset id.

    Args:
        name_or_path: Path to a local file/folder, or a hub dataset id such as ``"org/name"``.
        split: Split to load, with optional slicing (``"train[:5%]"``).
        config_name: Hub dataset configuration (subset) name; hub datasets only.
        revision: Hub branch, tag or commit; hub datasets only.

    Returns:
        The loaded ``datasets.Dataset``.

    Raises:
        FileNotFoundError: ``name_or_path`` looks like a path (starts with ``./``, ``../``, ``/`` or ``~``,
            or ends with a supported extension) but does not exist, or a folder has no data files.
        ValueError: Unsupported file type, a folder mixing file types, ``config_name``/``revision`` given
            for local data, or the dataset is empty.
    """
    if _looks_like_path(name_or_path):
        path = Path(name_or_path).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"Dataset path {name_or_path!r} does not exist (resolved to {str(path.resolve())!r}). "
                "Check the path, or pass a hub dataset id such as 'org/name'."
            )
        if config_name is not None or revision is not None:
            raise ValueError(
                f"config_name={config_name!r} and revision={revision!r} only apply to hub datasets, but "
                f"{name_or_path!r} is a local path; unset them."
            )
        builder, files = _local_data_files(path)
        # `datasets` fails on empty local files with StopIteration or "corresponds to no data",
        # neither of which says the data is empty.
        if not any(_has_records(f, builder) for f in files):
            raise ValueError(
                f"Dataset {name_or_path!r} is empty: its data files {files} hold no records. "
                "Point at the files that hold the data."
            )
        # The split key must be the bare name: "train[:100]" selects from the split called "train".
        split_name = re.split(r"[\[+]", split, maxsplit=1)[0]
        loaded = datasets.load_dataset(builder, data_files={split_name: files}, split=split)
    else:
        loaded = datasets.load_dataset(name_or_path, config_name, split=split, revision=revision)

    if not isinstance(loaded, datasets.Dataset):
        raise TypeError(
            f"Expected a datasets.Dataset for {name_or_path!r} split={split!r}, got {type(loaded).__name__}."
        )
    if len(loaded) == 0:
        raise ValueError(
            f"Dataset {name_or_path!r} split={split!r} is empty (0 records, columns {loaded.column_names}). "
            "Check the split name or slice, and the data files."
        )
    return loaded


# --------------------------------------------------------------------------------------------------
# Format detection and validation
# --------------------------------------------------------------------------------------------------


def detect_format(column_names: Sequence[str]) -> str:
    """Decide which record format a dataset holds from its column names.

    Priority: ``messages`` > ``prompt_completion`` (needs both ``prompt`` and ``completion``) > ``text``.

    Args:
        column_names: The dataset's column names.

    Returns:
        ``"messages"``, ``"prompt_completion"`` or ``"text"``.

    Raises:
        ValueError: None of the formats' columns are present; the message lists what was found.
    """
    columns = set(column_names)
    for name in DATASET_FORMATS:
        if columns.issuperset(_FORMAT_COLUMNS[name]):
            return name
    expected = "; ".join(f"{name}: {list(cols)}" for name, cols in _FORMAT_COLUMNS.items())
    raise ValueError(
        f"Cannot detect the dataset format from columns {list(column_names)}. Expected one of "
        f"({expected}). Rename the columns (e.g. dataset.rename_column('conversations', 'messages'))."
    )


def _record_error(source: str, index: int, columns: Sequence[str], problem: str, fix: str) -> ValueError:
    where = f"{source} record {index}" if source else f"record {index}"
    return ValueError(f"{where}: {problem} (columns found: {list(columns)}). {fix}")


def _required_string(record: Mapping[str, Any], column: str, source: str, index: int) -> str:
    value = record.get(column)
    if value is None:
        raise _record_error(
            source, index, list(record), f"column {column!r} is missing or None", "Fix or drop the record."
        )
    if not isinstance(value, str):
        raise _record_error(
            source,
            index,
            list(record),
            f"column {column!r} must be a string, got {type(value).__name__}",
            "Fix or drop the record.",
        )
    return value


def _validated_messages(record: Mapping[str, Any], source: str, index: int) -> list[dict[str, str]]:
    """Check a ``messages`` record and return its turns reduced to ``role`` and ``content``."""
    columns = list(record)
    messages = record.get("messages")
    if messages is None:
        raise _record_error(
            source, index, columns, "column 'messages' is missing or None", "Fix or drop the record."
        )
    if not isinstance(messages, list) or not messages:
        raise _record_error(
            source,
            index,
            columns,
            f"'messages' must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r:.200}",
            "Fix or drop the record.",
        )
    turns: list[dict[str, str]] = []
    for turn_index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise _record_error(
                source,
                index,
                columns,
                f"message {turn_index} must be a dict with 'role' and 'content', got {type(message).__name__}",
                "Fix or drop the record.",
            )
        role, content = message.get("role"), message.get("content")
        if role not in CHAT_ROLES:
            raise _record_error(
                source,
                index,
                columns,
                f"message {turn_index} has unknown role {role!r}; supported roles: {list(CHAT_ROLES)}",
                "Map the role to one of the supported ones or drop the record.",
            )
        if not isinstance(content, str):
            raise _record_error(
                source,
                index,
                columns,
                f"message {turn_index} ({role}) content must be a string, got {type(content).__name__}",
                "Only text content is supported; flatten multi-part content to a string.",
            )
        if role == "assistant" and not content.strip():
            raise _record_error(
                source,
                index,
                columns,
                f"message {turn_index} is an empty assistant turn",
                "Drop the record or the empty turn: it would teach the model to answer with nothing.",
            )
        # Only role and content are passed on: Arrow fills keys that other records have (name,
        # tool_calls, ...) with None, and templates test such keys with `is defined`.
        turns.append({"role": role, "content": content})
    if not any(turn["role"] == "assistant" for turn in turns):
        raise _record_error(
            source,
            index,
            columns,
            f"'messages' has no assistant turn (roles: {[turn['role'] for turn in turns]})",
            "Every conversation needs at least one assistant turn to learn from; drop the record.",
        )
    return turns


# --------------------------------------------------------------------------------------------------
# Tokenization
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenizeStats:
    """What `tokenize_dataset` did, so that nothing is dropped or cut silently.

    Attributes:
        num_records: Records tokenized (all are kept).
        num_truncated: Records longer than ``max_length`` that were right-truncated.
        num_without_targets: Records with no target token after truncation (kept; they add no loss).
            ``labels[0]`` is not counted as a target: no token precedes it, so it is never predicted.
    """

    num_records: int
    num_truncated: int
    num_without_targets: int


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


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


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


def _tokenize_messages(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, str]],
    *,
    assistant_only_loss: bool,
    special_ids: frozenset[int],
    source: str,
    index: int,
    columns: Sequence[str],
) -> tuple[list[int], list[int]]:
    """Render a conversation and mark its assistant tokens as targets by diffing prefix renders.

    For assistant turn ``i`` the target tokens are those of ``render(messages[:i + 1])`` beyond those of
    ``render(messages[:i], add_generation_prompt=True)``. This needs no ``{% generation %}`` markers in
    the template, but it needs every prefix render to tokenize to a prefix of the full render; templates
    that rewrite earlier turns (e.g. strip reasoning from past assistant turns) break that and are
    reported rather than mis-masked.
    """

    def render_ids(turns: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        try:
            rendered = tokenizer.apply_chat_template(
                turns, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as err:
            # Templates reject conversations with raise_exception (e.g. "roles must alternate"); the
            # bare message would not say which record.
            raise _record_error(
                source,
                index,
                columns,
                f"the chat template failed on this conversation: {err}",
                "Fix or drop the record, or use a template that accepts it.",
            ) from err
        assert isinstance(rendered, str), type(rendered)
        return _encode(tokenizer, rendered)

    input_ids = render_ids(messages, add_generation_prompt=False)
    if not assistant_only_loss:
        return input_ids, list(input_ids)

    labels = [IGNORE_INDEX] * len(input_ids)
    for turn_index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if turn_index == 0:
            # There is no prompt to diff against (templates refuse to render zero messages).
            raise _record_error(
                source,
                index,
                columns,
                "the conversation starts with an assistant turn, so there is no prompt to learn it from",
                "Drop the record or put the user/system turn before it, or set assistant_only_loss=False.",
            )
        before = render_ids(messages[:turn_index], add_generation_prompt=True)
        through = render_ids(messages[: turn_index + 1], add_generation_prompt=False)
        for name, prefix in (("prompt before", before), ("conversation through", through)):
            if input_ids[: len(prefix)] != prefix:
                raise _record_error(
                    source,
                    index,
                    columns,
                    f"the chat template's render of the {name} assistant turn {turn_index} does not "
                    "tokenize to a prefix of the whole conversation, so assistant tokens cannot be "
                    "located",
                    "Use a chat template that renders earlier turns identically whatever follows, or set "
                    "assistant_only_loss=False.",
                )
        end = _trim_after_end_of_turn(tokenizer, input_ids, len(before), len(through), special_ids)
        if end <= len(before):
            raise _record_error(
                source,
                index,
                columns,
                f"assistant turn {turn_index} rendered to no tokens with this chat template",
                "Check that the chat template renders assistant content.",
            )
        labels[len(before) : end] = input_ids[len(before) : end]
    return input_ids, labels


def tokenize_dataset(
    dataset: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    dataset_format: str = "auto",
    max_length: int,
    assistant_only_loss: bool = True,
    completion_only_loss: bool = True,
    source: str = "",
) -> tuple[datasets.Dataset, TokenizeStats]:
    """Tokenize records into ``input_ids`` and ``labels`` (``IGNORE_INDEX`` where there is no loss).

    * ``messages``: rendered with ``tokenizer.apply_chat_template`` and tokenized without adding special
      tokens (the template decides BOS). With ``assistant_only_loss`` only assistant turns are targets,
      each including the template's end-of-turn token (e.g. ``<|im_end|>``, which the model must learn to
      emit) but not whitespace the template puts after it.
    * ``prompt_completion``: ``[bos] + tokens(prompt) + tokens(completion) + [eos]``, BOS only if the
      tokenizer adds one by default. Prompt and completion are tokenized separately so their boundary
      is a token boundary. With ``completion_only_loss`` only completion and EOS are targets.
    * ``text``: ``[bos] + tokens(text) + [eos]``, all targets.

    Examples longer than ``max_length`` are right-truncated and counted. The original columns are removed.

    Args:
        dataset: Untokenized dataset, e.g. from `load_raw_dataset`.
        tokenizer: Tokenizer of the model; needs a chat template for ``messages`` and an EOS token for
            the other formats.
        dataset_format: ``"auto"`` (see `detect_format`), ``"messages"``, ``"prompt_completion"`` or
            ``"text"``.
        max_length: Maximum tokens per example.
        assistant_only_loss: ``messages`` only: loss on assistant turns only (else on every token).
        completion_only_loss: ``prompt_completion`` only: loss on the completion only (else every token).
        source: Name of the dataset used in error messages (e.g. its path).

    Returns:
        The tokenized dataset (columns ``input_ids`` and ``labels``) and its `TokenizeStats`.

    Raises:
        ValueError: Unknown ``dataset_format``, missing columns, ``max_length < 1``, a tokenizer without
            chat template / EOS, or an invalid record (the message names the record index).
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}.")
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
            f"{source or 'the dataset'} lacks {missing} (columns found: {columns}). Rename the columns or "
            "set dataset_format='auto'."
        )
    if dataset_format == "messages" and tokenizer.chat_template is None:
        raise ValueError(
            "The dataset has a 'messages' column but the tokenizer has no chat_template. Use the "
            "tokenizer of an instruct model, or set tokenizer.chat_template."
        )

    # Resolved once, outside the per-record function, so a missing EOS fails before any record.
    eos = _eos_id(tokenizer) if dataset_format != "messages" else None
    leading = _leading_special_ids(tokenizer) if dataset_format != "messages" else []
    special_ids = _special_ids(tokenizer)

    def tokenize_record(record: dict[str, Any], index: int) -> dict[str, Any]:
        if dataset_format == "messages":
            messages = _validated_messages(record, source, index)
            input_ids, labels = _tokenize_messages(
                tokenizer,
                messages,
                assistant_only_loss=assistant_only_loss,
                special_ids=special_ids,
                source=source,
                index=index,
                columns=list(record),
            )
        elif dataset_format == "prompt_completion":
            assert eos is not None
            prompt_ids = leading + _encode(tokenizer, _required_string(record, "prompt", source, index))
            completion_ids = _encode(tokenizer, _required_string(record, "completion", source, index)) + [eos]
            input_ids = prompt_ids + completion_ids
            prompt_labels = [IGNORE_INDEX] * len(prompt_ids) if completion_only_loss else prompt_ids
            labels = prompt_labels + completion_ids
        else:
            assert eos is not None
            input_ids = leading + _encode(tokenizer, _required_string(record, "text", source, index)) + [eos]
            labels = list(input_ids)

        truncated = len(input_ids) > max_length
        input_ids, labels = input_ids[:max_length], labels[:max_length]
        return {
            "input_ids": input_ids,
            "labels": labels,
            # Bookkeeping columns rather than closure counters, so the counts stay right if the map is
            # later run with num_proc or served from the cache.
            "_truncated": truncated,
            # labels[0] is never predicted (nothing precedes it), so it does not count as a target.
            "_has_targets": any(label != IGNORE_INDEX for label in labels[1:]),
        }

    tokenized = dataset.map(
        tokenize_record,
        with_indices=True,
        remove_columns=columns,
        load_from_cache_file=False,
        desc=f"Tokenizing {source}" if source else "Tokenizing",
    )
    stats = TokenizeStats(
        num_records=len(tokenized),
        num_truncated=sum(tokenized["_truncated"]),
        num_without_targets=len(tokenized) - sum(tokenized["_has_targets"]),
    )
    return tokenized.remove_columns(["_truncated", "_has_targets"]), stats


# --------------------------------------------------------------------------------------------------
# Batching and sampling
# --------------------------------------------------------------------------------------------------


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
            examples: Dicts with ``input_ids`` and ``labels`` of equal length.

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

    def state_dict(self) -> dict[str, int]:
        """Return ``{"epoch", "position"}``; ``position`` = indices this rank has yielded this epoch."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resume from a `state_dict` (O(1): the yielded indices are skipped, not replayed).

        Args:
            state: ``{"epoch": int, "position": int}``.

        Raises:
            ValueError: Missing keys, or a position outside ``[0, len(self)]`` (e.g. the dataset or the
                number of ranks changed since the state was saved).
        """
        missing = [key for key in ("epoch", "position") if key not in state]
        if missing:
            raise ValueError(f"Sampler state lacks {missing}; got keys {sorted(state)}.")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self):
            raise ValueError(
                f"Sampler state epoch={epoch} position={position} does not fit this sampler "
                f"({len(self)} indices per rank: {self.num_examples} examples over {self.world_size} ranks). "
                "Resume with the same dataset, max_length and number of processes as the saved run."
            )
        self.epoch, self.position = epoch, position


def build_dataloader(
    dataset: datasets.Dataset,
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
        dataset: Tokenized dataset from `tokenize_dataset`.
        batch_size: Examples per batch per rank.
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
