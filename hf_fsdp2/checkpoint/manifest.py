"""Per-file digests of a checkpoint (``manifest.json``), written at save time and checked before any use.

DCP checks neither the bytes of its shard files nor any checksum: a ``.distcp`` file damaged in place (a bad
disk, a copy cut short and padded, a stray write) loads without an error and trains or exports whatever it now
holds. The manifest names every file of the checkpoint with its size and digest::

    {"algorithm": "xxh3_128", "files": {"__0_0.distcp": {"bytes": 123, "digest": "..."}, ...}}

Cost: each rank hashes the files it wrote itself (its ``__<rank>_*.distcp`` shards and RNG file), right after
writing them, while they are still in the page cache, so the ranks hash in parallel; rank 0 adds the shared
small files and writes the manifest before ``trainer_state.json`` marks the checkpoint complete. xxh3-128
(the ``xxhash`` package, when installed) is the fast choice; the fallback is hashlib's sha256 (docs/checkpoints.md
gives both speeds as measured). A check (resume, offline export) reads every file once more: on resume that doubles the
bytes read from the checkpoint. Checkpoints written before manifests existed load with a warning.

Not collective: callers gather the per-rank digests (:mod:`hf_fsdp2.checkpoint.checkpointer`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

logger = logging.getLogger("hf_fsdp2")

MANIFEST_FILE = "manifest.json"
CHUNK_BYTES = 8 * 2**20


def default_algorithm() -> str:
    """``xxh3_128`` when the ``xxhash`` package is importable (much faster), else ``sha256`` (always there)."""
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return "sha256"
    return "xxh3_128"


def _hasher(algorithm: str) -> Any:
    if algorithm == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    if algorithm in hashlib.algorithms_available:
        return hashlib.new(algorithm)
    raise ValueError(
        f"checkpoint manifest algorithm {algorithm!r} is not available here; install the xxhash package "
        "(pip install xxhash) to check this checkpoint"
    )


def file_digest(path: Path, algorithm: str) -> str:
    """The hex digest of a file's bytes, read in chunks (constant memory)."""
    h = _hasher(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
    return str(h.hexdigest())


def rank_files(folder: Path, rank: int) -> list[str]:
    """The files of a checkpoint folder rank ``rank`` wrote itself: its DCP shards and its RNG state."""
    names = [p.name for p in folder.glob(f"__{rank}_*.distcp")]
    rng = folder / "rng" / f"rank{rank}.pt"
    return sorted(names) + (["rng/" + rng.name] if rng.is_file() else [])


def digest_files(folder: Path, relative: Iterable[str], algorithm: str) -> dict[str, dict[str, Any]]:
    """``relative path -> {"bytes", "digest"}`` of the named files of ``folder``."""
    return {
        rel: {"bytes": (folder / rel).stat().st_size, "digest": file_digest(folder / rel, algorithm)}
        for rel in relative
    }


def write_manifest(folder: Path, files: dict[str, dict[str, Any]], algorithm: str) -> None:
    """Write ``manifest.json`` atomically (a temporary file renamed), so a kill leaves it whole or absent."""
    tmp = folder / f".{MANIFEST_FILE}.tmp"
    tmp.write_text(
        json.dumps({"algorithm": algorithm, "files": dict(sorted(files.items()))}, indent=1) + "\n"
    )
    os.replace(tmp, folder / MANIFEST_FILE)


def manifest_problems(folder: Path) -> list[str]:
    """What the manifest finds wrong with a checkpoint's files (empty: every file as written, or no manifest).

    Every file the manifest names must exist with its size and digest, and every ``.distcp`` shard and the
    ``.metadata`` index of the folder must be named in it. A checkpoint without a manifest (written before
    manifests existed) gives no problem and a warning: its bytes cannot be checked.

    Returns:
        One line per problem, each naming the file (relative to ``folder``).
    """
    path = folder / MANIFEST_FILE
    if not path.is_file():
        logger.warning(
            "%s has no %s (written by an older hf_fsdp2): its files cannot be checked for damage",
            folder,
            MANIFEST_FILE,
        )
        return []
    try:
        manifest = json.loads(path.read_text())
        algorithm, files = str(manifest["algorithm"]), dict(manifest["files"])
    except (ValueError, KeyError, TypeError) as err:
        return [f"{MANIFEST_FILE} cannot be read ({type(err).__name__}: {err})"]
    problems = []
    for rel, entry in sorted(files.items()):
        file = folder / rel
        if not file.is_file():
            problems.append(f"{rel} is missing")
        elif file.stat().st_size != int(entry["bytes"]):
            problems.append(f"{rel} is {file.stat().st_size} bytes, {entry['bytes']} when written")
        elif file_digest(file, algorithm) != entry["digest"]:
            problems.append(
                f"{rel} is damaged: its {algorithm} digest differs from the one written at save time"
            )
    unlisted = sorted(p.name for p in folder.iterdir() if p.suffix == ".distcp" or p.name == ".metadata")
    problems += [f"{name} is not in {MANIFEST_FILE}" for name in unlisted if name not in files]
    return problems
