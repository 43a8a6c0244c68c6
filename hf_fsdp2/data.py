"""Datasets -> tokenized examples with loss masks, padding collator, resumable sharded sampling.

The pipeline a recipe runs, top to bottom::

    sources = resolve_sources(dataset_name="data/train.jsonl")            # or a weighted mixture
    data = build_sft_datasets(sources, tokenizer, max_length=2048, seed=0)  # tokenized, cached, summarised
    sampler = ShardedSampler(len(data.train), rank=rank, world_size=world_size, seed=seed)
    loader = build_dataloader(data.train, batch_size=8, collator=PaddingCollator(pad_id), sampler=sampler)

Packing several examples per row and padding-free batches live in `hf_fsdp2.packing`.

Record formats (see `detect_format`; a column mapping renames other column names first):

* ``messages``: OpenAI chat, a list of ``{"role", "content"}`` turns (system, user, assistant);
* ``conversations``: ShareGPT, a list of ``{"from", "value"}`` turns (``human``/``gpt``/``system``...);
* ``prompt_completion``: ``prompt`` and ``completion``, two strings or two lists of chat turns;
* ``alpaca``: ``instruction``, optional ``input``, ``output`` (and optional ``system``), rendered as a
  user/assistant chat with the tokenizer's chat template;
* ``text``: one string, loss on every token.

Every example comes out as ``input_ids`` and ``labels`` of the same length, plus ``length`` and
``num_targets``. ``labels`` are aligned with ``input_ids`` (not shifted): the loss shifts them, so
``labels[0]`` never contributes. ``IGNORE_INDEX`` (-100) marks tokens without loss.

Chat loss masks come from rendering prefixes of the conversation with the chat template and diffing
their tokens, so they are right for any template (no ``{% generation %}`` markers needed) and include
the end-of-turn token the model must learn to emit.

Nothing is dropped silently: every truncated, dropped or skipped record is counted in the summary the
recipe logs at start, and bad records are errors naming the source, the record index and the problem
unless ``on_bad_record="skip"``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import datasets
import numpy as np
import pyarrow.parquet
import torch
from datasets.fingerprint import Hasher
from torch.utils.data import DataLoader, Sampler
from torch.utils.data import Dataset as TorchDataset
from transformers import PreTrainedTokenizerBase

if TYPE_CHECKING:
    from hf_fsdp2.config import DataArgs

IGNORE_INDEX = -100
"""Label of tokens without loss: the default ``ignore_index`` of ``torch.nn.functional.cross_entropy``."""

DATASET_FORMATS = ("messages", "conversations", "prompt_completion", "alpaca", "text")
"""Record formats in the order `detect_format` tries them."""

CHAT_ROLES = ("system", "user", "assistant")
CHAT_LOSSES = ("assistant", "last_assistant", "all")
"""Chat targets: every assistant turn, the last assistant turn only, or every token."""
LONG_EXAMPLE_POLICIES = ("truncate", "drop", "error")
BAD_RECORD_POLICIES = ("error", "skip")

# ShareGPT speaker names -> chat roles.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}

# Local file suffix -> the `datasets` packaged builder that reads it. .json and .jsonl share a builder,
# so a folder may mix them; it may not mix other types.
_FILE_BUILDERS = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".txt": "text",
    ".arrow": "arrow",
}

# Columns each format needs: what `detect_format` looks for and `tokenize_dataset` checks.
_FORMAT_COLUMNS: dict[str, tuple[str, ...]] = {
    "messages": ("messages",),
    "conversations": ("conversations",),
    "prompt_completion": ("prompt", "completion"),
    "alpaca": ("instruction", "output"),
    "text": ("text",),
}
CANONICAL_COLUMNS = (
    "messages",
    "conversations",
    "prompt",
    "completion",
    "instruction",
    "input",
    "output",
    "system",
    "text",
)
"""Column names a ``dataset_column_mapping`` may map to."""

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


# --------------------------------------------------------------------------------------------------
# Sources: single dataset, weighted mixtures, column mappings
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataSource:
    """One dataset to read: a hub id or a local file/folder, with its subset, split, revision and weight.

    Attributes:
        name: Hub dataset id (``org/name``) or local path.
        subset: Hub configuration (subset) name.
        split: Split to read, with optional slicing (``train[:10%]``).
        revision: Hub branch, tag or commit.
        weight: How many times each record is used per epoch on average: ``0.5`` takes a seeded half of
            the records, ``2`` every record twice, ``1.5`` every record once and a seeded half again.
    """

    name: str
    subset: str | None = None
    split: str = "train"
    revision: str | None = None
    weight: float = 1.0

    def describe(self) -> str:
        """``name`` plus the subset, split and revision when they are not the defaults."""
        extras = [f"subset={self.subset}"] if self.subset else []
        extras += [f"split={self.split}"] if self.split != "train" else []
        extras += [f"revision={self.revision}"] if self.revision else []
        return f"{self.name} ({', '.join(extras)})" if extras else self.name


_SPEC_KEYS = {"subset": "subset", "config": "subset", "split": "split", "revision": "revision"}


def parse_source(spec: str, *, split: str = "train") -> DataSource:
    """Parse ``NAME[?subset=S&split=T&revision=R][:WEIGHT]`` into a `DataSource`.

    ``NAME`` is a hub id or a local path. The weight is the part after the last ``:`` when it is a
    number; anything else after a ``:`` stays part of the name.

    Args:
        spec: The source specification, e.g. ``"HuggingFaceH4/ultrachat_200k?split=train_sft:0.3"``.
        split: Split used when the spec does not name one.

    Returns:
        The source.

    Raises:
        ValueError: An empty name, an unknown ``?key``, or a weight that is not a positive finite number.
    """
    text = spec.strip()
    weight = 1.0
    head, sep, tail = text.rpartition(":")
    if sep and re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|[+-]?(inf|nan)", tail.strip()):
        weight, text = float(tail), head
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(
                f"Source {spec!r}: weight {tail.strip()} must be a positive number such as 0.5 or 2."
            )
    name, _, query = text.partition("?")
    name = name.strip()
    if not name:
        raise ValueError(f"Source {spec!r} has no dataset name or path.")
    values: dict[str, str] = {"split": split}
    for item in filter(None, query.split("&")):
        key, eq, value = item.partition("=")
        if not eq or key.strip() not in _SPEC_KEYS or not value.strip():
            raise ValueError(
                f"Source {spec!r}: cannot read {item!r}; use NAME?subset=S&split=T&revision=R:WEIGHT "
                f"with keys {sorted(_SPEC_KEYS)}."
            )
        values[_SPEC_KEYS[key.strip()]] = value.strip()
    return DataSource(
        name=name,
        subset=values.get("subset"),
        split=values["split"],
        revision=values.get("revision"),
        weight=weight,
    )


def _split_entries(entries: str | Sequence[str]) -> list[str]:
    items = [entries] if isinstance(entries, str) else list(entries)
    return [part.strip() for item in items for part in item.split(",") if part.strip()]


def resolve_sources(
    *,
    dataset_name: str | None = None,
    dataset_config_name: str | None = None,
    dataset_split: str = "train",
    dataset_revision: str | None = None,
    dataset_mixture: str | Sequence[str] = (),
) -> list[DataSource]:
    """The training sources: one dataset, or a weighted mixture.

    Args:
        dataset_name: One hub id or local path (with ``dataset_config_name``, ``dataset_split`` and
            ``dataset_revision``).
        dataset_config_name: Hub subset of ``dataset_name``.
        dataset_split: Split of ``dataset_name``, and the default split of mixture entries.
        dataset_revision: Hub revision of ``dataset_name``.
        dataset_mixture: ``"a:0.5,b:2"`` or ``["a:0.5", "b:2"]``: sources in `parse_source` syntax.

    Returns:
        The sources, in the given order.

    Raises:
        ValueError: Neither or both of ``dataset_name`` and ``dataset_mixture``, or a bad entry.
    """
    entries = _split_entries(dataset_mixture)
    if bool(dataset_name) == bool(entries):
        raise ValueError(
            "Give exactly one of dataset_name (one dataset) and dataset_mixture (several, weighted); got "
            f"dataset_name={dataset_name!r}, dataset_mixture={entries!r}."
        )
    if dataset_name:
        return [DataSource(dataset_name, dataset_config_name, dataset_split, dataset_revision)]
    sources = [parse_source(entry, split=dataset_split) for entry in entries]
    described = [s.describe() for s in sources]
    duplicates = sorted({d for d in described if described.count(d) > 1})
    if duplicates:
        raise ValueError(
            f"dataset_mixture lists {duplicates} more than once; give each source once with its weight."
        )
    return sources


def parse_column_mapping(entries: str | Sequence[str]) -> dict[str, str]:
    """Parse ``"question=prompt,answer=completion"`` (or a list of ``"a=b"``) into ``{"question": "prompt", ...}``.

    Args:
        entries: One string of comma-separated ``old=new`` pairs, or a list of them.

    Returns:
        Dataset column name -> the name the pipeline expects (one of ``CANONICAL_COLUMNS``).

    Raises:
        ValueError: A pair without ``=``, a target that is not a known column, or a column mapped twice.
    """
    mapping: dict[str, str] = {}
    for pair in _split_entries(entries):
        old, eq, new = (part.strip() for part in pair.partition("="))
        if not eq or not old or not new:
            raise ValueError(f"dataset_column_mapping entry {pair!r} must look like 'old_name=new_name'.")
        if new not in CANONICAL_COLUMNS:
            raise ValueError(
                f"dataset_column_mapping {pair!r}: {new!r} is not a column the pipeline reads; map to one of "
                f"{list(CANONICAL_COLUMNS)}."
            )
        if old in mapping or new in mapping.values():
            raise ValueError(f"dataset_column_mapping maps {old!r} or to {new!r} twice: {entries!r}.")
        mapping[old] = new
    return mapping


def apply_column_mapping(
    dataset: datasets.Dataset, mapping: Mapping[str, str], source: str
) -> datasets.Dataset:
    """Rename the columns of ``mapping`` that the dataset has.

    A mapped column the dataset lacks is an error unless the dataset already has the target column
    (a mixture of sources, some already in the expected names).

    Raises:
        ValueError: A mapped column is missing, or its target already exists.
    """
    columns = list(dataset.column_names)
    renames = {}
    for old, new in mapping.items():
        if old in columns:
            if new in columns:
                raise ValueError(
                    f"{source}: dataset_column_mapping {old}={new}, but the dataset already has a column "
                    f"{new!r} (columns: {columns}); drop that entry or map the other column."
                )
            renames[old] = new
        elif new not in columns:
            raise ValueError(
                f"{source}: dataset_column_mapping maps column {old!r}, which the dataset lacks "
                f"(columns: {columns}). Fix the mapping."
            )
    return dataset.rename_columns(renames) if renames else dataset


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
                f"supported: {', '.join(_FILE_BUILDERS)}. Convert the file to one of them."
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
            "(JSON and JSON Lines count as one). Move the other files out or point at one file."
        )
    return builders.pop(), [str(p) for p in files]


def _has_records(path: str, builder: str) -> bool:
    """True when a data file holds at least one record; cheap (Parquet footer, first non-blank byte)."""
    if builder == "parquet":
        return bool(pyarrow.parquet.read_metadata(path).num_rows > 0)
    if builder == "arrow":
        return os.path.getsize(path) > 0
    with open(path, "rb") as f:
        if builder == "csv":
            f.readline()  # the header line is not a record
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return True
    return False


def _paragraphs(batch: dict[str, list[str]]) -> dict[str, list[str]]:
    texts = [text.strip() for text in batch["text"]]
    return {"text": [text for text in texts if text]}


def _json_document(path: str) -> bool:
    """True when a .json file is one JSON document (an array of records), not JSON Lines."""
    with open(path, "rb") as fh:
        head = fh.read(1 << 16).lstrip()
    if not head.startswith(b"["):
        return False
    try:
        with open(path, encoding="utf-8") as fh:
            return isinstance(json.load(fh), list)
    except (ValueError, UnicodeDecodeError):
        return False


def scan_json_lines(files: Sequence[str]) -> list[str]:
    """Lines of JSON Lines files that are not a JSON object in UTF-8: ``"file:line: problem"`` each."""
    bad: list[str] = []
    for path in files:
        if path.endswith(".json") and _json_document(path):
            continue
        with open(path, "rb") as fh:
            for number, raw in enumerate(fh, start=1):
                if not raw.strip():
                    continue
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    bad.append(f"{path}:{number}: not UTF-8 text (byte 0x{raw[err.start]:02x} at column {err.start + 1})")
                    continue
                try:
                    record = json.loads(text)
                except json.JSONDecodeError as err:
                    bad.append(f"{path}:{number}: not valid JSON ({err.msg} at column {err.colno})")
                    continue
                if not isinstance(record, dict):
                    bad.append(f"{path}:{number}: a JSON {type(record).__name__}, not an object (a record)")
    return bad


def _good_json_records(files: list[str], stamps: list[tuple[int, int]]) -> Iterator[dict[str, Any]]:
    """The records of JSON Lines files, skipping the lines :func:`scan_json_lines` reports
    (``stamps``, each file's size and mtime, key the datasets cache)."""
    del stamps
    for path in files:
        if path.endswith(".json") and _json_document(path):
            with open(path, encoding="utf-8") as fh:
                yield from json.load(fh)
            continue
        with open(path, "rb") as fh:
            for raw in fh:
                try:
                    record = json.loads(raw.decode("utf-8")) if raw.strip() else None
                except (UnicodeDecodeError, json.JSONDecodeError):
                    continue
                if isinstance(record, dict):
                    yield record


def _first_undecodable(files: Sequence[str]) -> str | None:
    """``"file:line"`` of the first line that is not UTF-8, if any."""
    for path in files:
        with open(path, "rb") as fh:
            for number, raw in enumerate(fh, start=1):
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    return f"{path}:{number} (byte 0x{raw[err.start]:02x} at column {err.start + 1})"
    return None


def load_raw_dataset(
    name_or_path: str,
    *,
    split: str = "train",
    config_name: str | None = None,
    revision: str | None = None,
    on_bad_record: str = "error",
    bad_lines: list[str] | None = None,
) -> datasets.Dataset:
    """Load an untokenized dataset from a local file or folder, or from the hub.

    Local data: a ``.jsonl``, ``.json``, ``.parquet``, ``.csv``, ``.txt`` or ``.arrow`` file, a folder of
    files of one of those types (searched recursively, hidden entries skipped), or a folder written by
    ``Dataset.save_to_disk``. A ``.txt`` file gives one ``text`` record per paragraph (blank-line
    separated). The local files become the split named by ``split``, so slices such as
    ``"train[:1000]"`` work for local data too. Anything that does not look like a path is passed to
    ``datasets.load_dataset`` as a hub dataset id.

    Args:
        name_or_path: Path to a local file/folder, or a hub dataset id such as ``"org/name"``.
        split: Split to load, with optional slicing (``"train[:5%]"``).
        config_name: Hub dataset configuration (subset) name; hub datasets only.
        revision: Hub branch, tag or commit; hub datasets only.
        on_bad_record: local JSON Lines files: ``"error"`` refuses a line that is not a UTF-8 JSON object,
            naming the file and line; ``"skip"`` leaves such lines out.
        bad_lines: where the skipped lines are reported (``"file:line: problem"``).

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
        if path.is_dir() and (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
            saved = datasets.load_from_disk(str(path))
            if not isinstance(saved, datasets.Dataset):
                raise TypeError(
                    f"{name_or_path!r} holds a saved DatasetDict with splits {list(saved)}; point at one "
                    "split's folder."
                )
            loaded: Any = saved
        else:
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
            kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
            bad = scan_json_lines(files) if builder == "json" else []
            if bad and on_bad_record != "skip":
                raise ValueError(
                    f"{bad[0]}; {len(bad)} such line(s) in {name_or_path!r}. Fix or remove them, or set "
                    "on_bad_record=skip to skip them (they are counted)."
                )
            try:
                if bad:
                    stamps = [(os.path.getsize(f), int(os.path.getmtime(f))) for f in files]
                    loaded = datasets.Dataset.from_generator(
                        _good_json_records, gen_kwargs={"files": files, "stamps": stamps}, split=split_name
                    )
                    if split != split_name:
                        loaded = datasets.load_dataset(  # the slice of a split, as for any local data
                            "arrow", data_files={split_name: [c["filename"] for c in loaded.cache_files]},
                            split=split,
                        )  # fmt: skip
                    if bad_lines is not None:
                        bad_lines.extend(bad)
                else:
                    loaded = datasets.load_dataset(builder, data_files={split_name: files}, split=split, **kwargs)
            except (UnicodeDecodeError, datasets.exceptions.DatasetGenerationError) as err:
                cause: BaseException | None = err
                while cause is not None and not isinstance(cause, UnicodeDecodeError):
                    cause = cause.__cause__ or cause.__context__
                if cause is None:
                    raise ValueError(f"{name_or_path!r} could not be read: {err.__cause__ or err}") from None
                where = _first_undecodable(files)
                raise ValueError(
                    f"{where or name_or_path}: not UTF-8 text; convert the file to UTF-8 "
                    "(e.g. iconv -f latin1 -t utf-8)"
                ) from None
            if builder == "text":
                # Paragraph splitting leaves stray newlines and whitespace-only records around long gaps.
                loaded = loaded.map(_paragraphs, batched=True, desc="Splitting paragraphs")
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


def load_source(
    source: DataSource, *, on_bad_record: str = "error", bad_lines: list[str] | None = None
) -> datasets.Dataset:
    """`load_raw_dataset` for a `DataSource`."""
    return load_raw_dataset(
        source.name,
        split=source.split,
        config_name=source.subset,
        revision=source.revision,
        on_bad_record=on_bad_record,
        bad_lines=bad_lines,
    )


# --------------------------------------------------------------------------------------------------
# Format detection and record validation
# --------------------------------------------------------------------------------------------------


def detect_format(column_names: Sequence[str]) -> str:
    """Decide which record format a dataset holds from its column names.

    Priority: ``messages`` > ``conversations`` > ``prompt_completion`` (needs ``prompt`` and
    ``completion``) > ``alpaca`` (needs ``instruction`` and ``output``) > ``text``.

    Args:
        column_names: The dataset's column names (after any column mapping).

    Returns:
        One of ``DATASET_FORMATS``.

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
        f"({expected}). Rename the columns with dataset_column_mapping (e.g. 'question=prompt,answer=completion')."
    )


class RecordError(ValueError):
    """A record that cannot become a training example: names the source, the record and the problem.

    Attributes:
        reason: A short category (``"wrong role order"``, ``"missing field"``...) used to count skipped
            records by reason.
    """

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        # Exceptions pickle through their args; the extra attribute must survive `num_proc` workers.
        return (RecordError, (str(self), self.reason))


def _record_error(
    source: str, index: int, columns: Sequence[str], problem: str, fix: str, reason: str
) -> RecordError:
    where = f"{source} record {index}" if source else f"record {index}"
    return RecordError(f"{where}: {problem} (columns found: {list(columns)}). {fix}", reason)


_FIX = "Fix or drop the record, or set on_bad_record=skip to skip such records."


def _required_string(record: Mapping[str, Any], column: str, source: str, index: int) -> str:
    value = record.get(column)
    if value is None:
        raise _record_error(
            source, index, list(record), f"column {column!r} is missing or None", _FIX, "missing field"
        )
    if not isinstance(value, str):
        raise _record_error(
            source,
            index,
            list(record),
            f"column {column!r} must be a string, got {type(value).__name__}",
            _FIX,
            "non-string content",
        )
    return value


def _validated_turns(
    turns_value: Any,
    record: Mapping[str, Any],
    source: str,
    index: int,
    *,
    column: str,
    role_key: str,
    content_key: str,
    role_names: Mapping[str, str],
) -> list[dict[str, str]]:
    """Check a list of chat turns and return them as ``{"role", "content"}`` dicts (other keys dropped)."""
    columns = list(record)
    if turns_value is None:
        raise _record_error(
            source, index, columns, f"column {column!r} is missing or None", _FIX, "missing field"
        )
    if not isinstance(turns_value, list) or not turns_value:
        raise _record_error(
            source,
            index,
            columns,
            f"{column!r} must be a non-empty list of {{{role_key!r}, {content_key!r}}} dicts, got {turns_value!r:.200}",
            _FIX,
            "missing field",
        )
    turns: list[dict[str, str]] = []
    for turn_index, message in enumerate(turns_value):
        if not isinstance(message, Mapping):
            raise _record_error(
                source,
                index,
                columns,
                f"message {turn_index} must be a dict with {role_key!r} and {content_key!r}, got "
                f"{type(message).__name__}",
                _FIX,
                "missing field",
            )
        raw_role, content = message.get(role_key), message.get(content_key)
        role = role_names.get(raw_role) if isinstance(raw_role, str) else None
        if role is None:
            raise _record_error(
                source,
                index,
                columns,
                f"message {turn_index} has unknown role {raw_role!r}; supported roles: {list(role_names)}",
                "Map the role to one of the supported ones or drop the record.",
                "unknown role",
            )
        if content is None and content_key not in message:
            raise _record_error(
                source,
                index,
                columns,
                f"message {turn_index} ({role}) has no {content_key!r}",
                _FIX,
                "missing field",
            )
        if not isinstance(content, str):
            raise _record_error(
                source,
                index,
                columns,
                f"message {turn_index} ({role}) content must be a string, got {type(content).__name__}",
                "Only text content is supported; flatten multi-part content to a string.",
                "non-string content",
            )
        if role == "assistant" and not content.strip():
            raise _record_error(
                source,
                index,
                columns,
                f"message {turn_index} is an empty assistant turn",
                "Drop the record or the empty turn: it would teach the model to answer with nothing.",
                "empty assistant turn",
            )
        # Only role and content are passed on: Arrow fills keys that other records have (name,
        # tool_calls, ...) with None, and templates test such keys with `is defined`.
        turns.append({"role": role, "content": content})
    return turns


def _check_role_order(
    turns: list[dict[str, str]], record: Mapping[str, Any], source: str, index: int
) -> None:
    """Optional system turn, then user and assistant alternating, starting with user, ending with assistant."""
    roles = [turn["role"] for turn in turns]
    if "assistant" not in roles:
        raise _record_error(
            source,
            index,
            list(record),
            f"the conversation has no assistant turn (roles: {roles})",
            "Every conversation needs at least one assistant turn to learn from; drop the record.",
            "no assistant turn",
        )
    body = roles[1:] if roles[0] == "system" else roles
    expected = ["user" if i % 2 == 0 else "assistant" for i in range(len(body))]
    if body != expected or body[-1:] != ["assistant"]:
        raise _record_error(
            source,
            index,
            list(record),
            f"wrong role order {roles}: expected an optional system turn, then user and assistant turns "
            "alternating, starting with user and ending with assistant",
            _FIX,
            "wrong role order",
        )


# --------------------------------------------------------------------------------------------------
# Records -> what to tokenize
# --------------------------------------------------------------------------------------------------


@dataclass
class _Chat:
    """A conversation and the indices of the assistant turns to train on (None: every token)."""

    messages: list[dict[str, str]]
    trained: list[int] | None


@dataclass
class _Plain:
    """``[bos] + prompt + completion + [eos]``; ``prompt`` is a target when ``train_prompt``."""

    prompt: str
    completion: str
    train_prompt: bool


def _trained_turns(messages: list[dict[str, str]], chat_loss: str, first: int = 0) -> list[int] | None:
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= first]
    if chat_loss == "all":
        return None
    if chat_loss == "last_assistant":
        return assistant[-1:]
    return assistant


def _normalise_record(
    record: Mapping[str, Any],
    dataset_format: str,
    *,
    chat_loss: str,
    completion_only_loss: bool,
    source: str,
    index: int,
) -> _Chat | _Plain:
    """Turn a record of any format into a conversation or a plain prompt/completion (or text)."""
    if dataset_format == "messages":
        turns = _validated_turns(
            record.get("messages"), record, source, index,
            column="messages", role_key="role", content_key="content", role_names={r: r for r in CHAT_ROLES},
        )  # fmt: skip
        _check_role_order(turns, record, source, index)
        return _Chat(turns, _trained_turns(turns, chat_loss))
    if dataset_format == "conversations":
        turns = _validated_turns(
            record.get("conversations"), record, source, index,
            column="conversations", role_key="from", content_key="value", role_names=SHAREGPT_ROLES,
        )  # fmt: skip
        system = record.get("system")
        if isinstance(system, str) and system.strip() and turns[0]["role"] != "system":
            turns.insert(0, {"role": "system", "content": system})
        _check_role_order(turns, record, source, index)
        return _Chat(turns, _trained_turns(turns, chat_loss))
    if dataset_format == "alpaca":
        instruction = _required_string(record, "instruction", source, index)
        output = _required_string(record, "output", source, index)
        extra = record.get("input")
        if extra is not None and not isinstance(extra, str):
            raise _record_error(
                source, index, list(record), f"column 'input' must be a string, got {type(extra).__name__}",
                _FIX, "non-string content",
            )  # fmt: skip
        user = f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction
        alpaca_turns = [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
        system = record.get("system")
        if isinstance(system, str) and system.strip():
            alpaca_turns.insert(0, {"role": "system", "content": system})
        if not output.strip():
            raise _record_error(
                source, index, list(record), "column 'output' is an empty assistant turn",
                "Drop the record: it would teach the model to answer with nothing.", "empty assistant turn",
            )  # fmt: skip
        return _Chat(alpaca_turns, _trained_turns(alpaca_turns, chat_loss))
    if dataset_format == "prompt_completion":
        prompt, completion = record.get("prompt"), record.get("completion")
        if isinstance(prompt, list) or isinstance(completion, list):
            # Conversational prompt/completion (as in TRL): two lists of turns rendered as one chat.
            names = {r: r for r in CHAT_ROLES}
            prompt_turns = _validated_turns(
                prompt,
                record,
                source,
                index,
                column="prompt",
                role_key="role",
                content_key="content",
                role_names=names,
            )
            completion_turns = _validated_turns(
                completion, record, source, index,
                column="completion", role_key="role", content_key="content", role_names=names,
            )  # fmt: skip
            turns = prompt_turns + completion_turns
            _check_role_order(turns, record, source, index)
            first = len(prompt_turns)
            return _Chat(turns, _trained_turns(turns, "assistant", first) if completion_only_loss else None)
        prompt_text = _required_string(record, "prompt", source, index)
        completion_text = _required_string(record, "completion", source, index)
        if not completion_text.strip():
            raise _record_error(
                source, index, list(record), "column 'completion' is empty",
                "Drop the record: it would teach the model to answer with nothing.", "empty completion",
            )  # fmt: skip
        return _Plain(prompt_text, completion_text, train_prompt=not completion_only_loss)
    text = _required_string(record, "text", source, index)
    if not text.strip():
        raise _record_error(source, index, list(record), "column 'text' is empty", _FIX, "empty text")
    return _Plain("", text, train_prompt=True)


# --------------------------------------------------------------------------------------------------
# Tokenization
# --------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# Sources -> train (weighted mixture) and eval datasets, with a summary
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
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
    eval_source: DataSource | None = None,
    eval_split_fraction: float = 0.0,
    load: Callable[[DataSource], datasets.Dataset] = load_source,
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
        eval_source: A separate eval source (its weight is ignored), or None.
        eval_split_fraction: Fraction of the training examples held out for eval, in ``[0, 1)``.
        load: How a source is read (tests replace it).

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
        loaded = load(source) if load is not load_source else load_source(
            source, on_bad_record=on_bad_record, bad_lines=bad_lines
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
    train = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)

    eval_set: datasets.Dataset | None = None
    description = ""
    if eval_source is not None:
        eval_set, eval_stats = tokenized(eval_source)
        all_stats.append(eval_stats)
        description = f"from {eval_source.describe()}"
    elif eval_split_fraction > 0:
        eval_set = eval_parts[0] if len(eval_parts) == 1 else datasets.concatenate_datasets(eval_parts)
        description = f"{eval_split_fraction:g} of each source held out from train, seed {seed}"
    if eval_set is not None and len(eval_set) == 0:
        raise ValueError(
            f"The eval set ({description}) has no example; raise eval_split_fraction or fix the source."
        )
    return SFTData(train, eval_set, all_stats, counts, description)


# --------------------------------------------------------------------------------------------------
# Showing what the model learns
# --------------------------------------------------------------------------------------------------

_GREEN, _RESET = "\x1b[42;30m", "\x1b[0m"


def build_sft_datasets_from_config(
    d: DataArgs,
    tokenizer: PreTrainedTokenizerBase,
    *,
    seed: int,
    load: Callable[[DataSource], datasets.Dataset] = load_source,
) -> SFTData:
    """:func:`build_sft_datasets` with every setting taken from a recipe's data section.

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
        eval_source=parse_source(d.eval_dataset_name, split=d.eval_dataset_split)
        if d.eval_dataset_name
        else None,
        eval_split_fraction=d.eval_split_fraction,
        load=load,
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
        dataset: Tokenized dataset from `tokenize_dataset`, or packed rows (`hf_fsdp2.packing.PackedDataset`).
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
