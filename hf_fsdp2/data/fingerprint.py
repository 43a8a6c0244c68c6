"""Fingerprints of a run's local data files, kept in every checkpoint so that a resume notices a file changed in
place since (the data position it restores would then point into other data).

A file's fingerprint is its size and a digest of its first and last MiB (the whole file when smaller): cheap on
a corpus of any size, and blind only to a same-size edit in the middle of a file larger than 2 MiB. Hub datasets
are pinned by ``dataset_revision`` (a config key a resume already compares) and have no fingerprint here.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

EDGE = 1 << 20  # bytes read from each end of a file


def file_fingerprint(path: Path) -> str:
    """``"<size>:<sha256 of the first and last MiB>"`` (16 hex digits)."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        digest.update(fh.read(EDGE))
        if size > EDGE:
            fh.seek(max(EDGE, size - EDGE))
            digest.update(fh.read(EDGE))
    return f"{size}:{digest.hexdigest()[:16]}"


def _files(name: str) -> list[Path]:
    path = Path(os.path.expanduser(name))
    if path.is_file():
        return [path]
    if path.is_dir():  # hidden entries are caches or VCS metadata, as the loader skips them
        return sorted(
            p
            for p in path.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
    return []


def data_fingerprint(names: Iterable[str]) -> dict[str, str]:
    """Fingerprints of every local file the sources ``names`` (paths or hub ids) read, by absolute path."""
    out: dict[str, str] = {}
    for name in names:
        for file in _files(name):
            out[str(file.resolve())] = file_fingerprint(file)
    return out


def changed_files(saved: dict[str, str], now: dict[str, str]) -> list[str]:
    """One line per file of ``saved`` that is gone or differs now (size and digest named)."""
    lines = []
    for path, before in sorted(saved.items()):
        after = now.get(path)
        if after is None:
            lines.append(f"{path} is gone")
        elif after != before:
            size_before, size_after = before.split(":")[0], after.split(":")[0]
            what = (
                f"{size_before} -> {size_after} bytes"
                if size_before != size_after
                else "same size, other bytes"
            )
            lines.append(f"{path} changed ({what})")
    return lines
