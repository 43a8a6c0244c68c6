"""Where training records come from, as configured: a dataset name or path, or a weighted mixture, and
column mappings (parsed and checked here; read by ``hf_fsdp2.data.loading``)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

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
    "tools",
)
"""Column names a ``dataset_column_mapping`` may map to."""


@dataclass(frozen=True, kw_only=True)
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
        return [
            DataSource(
                name=dataset_name, subset=dataset_config_name, split=dataset_split, revision=dataset_revision
            )
        ]
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
