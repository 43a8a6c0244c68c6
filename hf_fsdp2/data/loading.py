"""Reading a source into an untokenized ``datasets.Dataset``: local files and folders (JSON Lines read
line by line when a line is not a UTF-8 JSON object, naming the file and line), saved datasets, hub ids."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import pyarrow.parquet

from hf_fsdp2.config.sources import DataSource

if TYPE_CHECKING:
    pass


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
                    bad.append(
                        f"{path}:{number}: not UTF-8 text (byte 0x{raw[err.start]:02x} at column {err.start + 1})"
                    )
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
    text_unit: str = "paragraph",
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
        text_unit: what one record of a ``.txt`` file is: ``paragraph``, ``document`` (the whole file) or
            ``line``.

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
            kwargs = {"sample_by": text_unit} if builder == "text" else {}
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
                            "arrow",
                            data_files={split_name: [c["filename"] for c in loaded.cache_files]},
                            split=split,
                        )
                    if bad_lines is not None:
                        bad_lines.extend(bad)
                else:
                    loaded = datasets.load_dataset(
                        builder, data_files={split_name: files}, split=split, **kwargs
                    )
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
                loaded = loaded.map(_paragraphs, batched=True, desc="Dropping empty records")
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
    source: DataSource,
    *,
    on_bad_record: str = "error",
    bad_lines: list[str] | None = None,
    text_unit: str = "paragraph",
) -> datasets.Dataset:
    """`load_raw_dataset` for a `DataSource`."""
    return load_raw_dataset(
        source.name,
        split=source.split,
        config_name=source.subset,
        revision=source.revision,
        on_bad_record=on_bad_record,
        bad_lines=bad_lines,
        text_unit=text_unit,
    )


def stream_source(source: DataSource, *, text_unit: str = "paragraph") -> Any:
    """A ``datasets.IterableDataset`` of a source's records, read as they are consumed (``streaming``).

    Local files stream with the same builders as :func:`load_raw_dataset`; a hub id streams from the hub.

    Raises:
        FileNotFoundError: a path that does not exist or a folder without data files.
    """
    if _looks_like_path(source.name):
        path = Path(source.name).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"Dataset path {source.name!r} does not exist (resolved to {str(path.resolve())!r})."
            )
        builder, files = _local_data_files(path)
        kwargs = {"sample_by": text_unit} if builder == "text" else {}
        return datasets.load_dataset(
            builder, data_files={"train": files}, split="train", streaming=True, **kwargs
        )
    return datasets.load_dataset(
        source.name, source.subset, split=source.split, revision=source.revision, streaming=True
    )


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
