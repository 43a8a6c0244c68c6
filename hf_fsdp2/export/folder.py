"""What a model folder must hold, checked without loading it, and the record an export keeps of its verification.

The checks read headers and small JSON files only (no torch, no transformers): ``hf-fsdp2 push`` runs them before
an upload, dry run or not, and every command that takes a model folder runs them before it loads anything, so a
damaged folder is one line naming the file rather than a loader's traceback.

The record (``RECORD_NAME``, hidden: the push's ignore patterns leave it out of the upload) is written into the
staging folder after the verification passed (or with ``verified: null`` when it was skipped) and published with
the files: it lists each file's size then, so a file replaced afterwards no longer counts as verified.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RECORD_NAME = ".hf_fsdp2_export.json"
CONFIG_NAME = "config.json"
ADAPTER_CONFIG = "adapter_config.json"
_WEIGHTS = "model.safetensors"
_INDEX = "model.safetensors.index.json"
_ADAPTER_WEIGHTS = "adapter_model.safetensors"
# JSON files whose damage breaks a load.
_JSON_FILES = (
    CONFIG_NAME,
    ADAPTER_CONFIG,
    "generation_config.json",
    _INDEX,
    "tokenizer_config.json",
    "tokenizer.json",
)
_HEADER_LIMIT = 100 * 2**20  # larger is not a safetensors header but random bytes read as a length


def json_problem(path: Path) -> str | None:
    """Why ``path`` is not a JSON object (unreadable, not UTF-8, invalid JSON, another type), or None."""
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        return f"{path} is not a text file (byte {err.start}: not UTF-8)"
    except json.JSONDecodeError as err:
        return f"{path} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})"
    except OSError as err:
        return f"{path} cannot be read ({err.strerror or err})"
    if not isinstance(value, dict):
        return f"{path} holds a JSON {type(value).__name__}, not an object"
    return None


def safetensors_header(path: Path) -> dict[str, Any]:
    """The tensors a safetensors file declares (``__metadata__`` left out), checked against the file's size.

    Raises:
        ValueError: the file is not a whole safetensors file; the message names it and what is wrong.
    """
    size = path.stat().st_size
    with path.open("rb") as fh:
        raw = fh.read(8)
        n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if not 2 <= n <= min(_HEADER_LIMIT, size - 8):
            raise ValueError(
                f"{path} is not a safetensors file (its first 8 bytes give no valid header length)"
            )
        try:
            header = json.loads(fh.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path} is not a safetensors file (its header is not JSON: {err})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file (its header is not a JSON object)")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    try:
        end = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        raise ValueError(f"{path} is not a safetensors file (its header has no valid data_offsets)") from None
    if size != 8 + n + end:
        raise ValueError(f"{path} is {size} bytes but its header says {8 + n + end}: truncated or padded")
    return tensors


def folder_problems(root: Path, names: list[str] | None = None) -> list[str]:
    """What makes ``root`` (or its files ``names``, relative paths) fail to load as a model or adapter folder.

    Checked: a config (``config.json`` or ``adapter_config.json``) that parses, the weights a loader opens, each
    safetensors file's header against its size, the index against the files' headers. A training checkpoint (DCP
    shards) is named as such, with the command that exports it.

    Returns:
        One message per problem, each naming the file; empty when the folder passes.
    """
    if names is None:
        names = [p.name for p in sorted(root.iterdir()) if p.is_file()]  # what a loader opens is at the top
    present = set(names)
    if not present & {CONFIG_NAME, ADAPTER_CONFIG}:
        return [not_a_model_folder(root)]
    problems = [p for name in _JSON_FILES if name in present if (p := json_problem(root / name))]
    if CONFIG_NAME in present and not present & {_WEIGHTS, _INDEX}:
        problems.append(f"{root} has {CONFIG_NAME} but no weights ({_WEIGHTS} or {_INDEX})")
    if ADAPTER_CONFIG in present and CONFIG_NAME not in present and _ADAPTER_WEIGHTS not in present:
        problems.append(f"{root} has {ADAPTER_CONFIG} but no {_ADAPTER_WEIGHTS}")
    headers: dict[str, dict[str, Any]] = {}
    for name in sorted(n for n in present if n.endswith(".safetensors")):
        try:
            headers[name] = safetensors_header(root / name)
        except (ValueError, OSError) as err:
            problems.append(str(err))
    if _INDEX in present and not any(_INDEX in p for p in problems):
        problems += _index_problems(root, json.loads((root / _INDEX).read_text()), headers)
    return problems


def _index_problems(root: Path, index: dict[str, Any], headers: dict[str, dict[str, Any]]) -> list[str]:
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        return [f"{root / _INDEX} has no weight_map"]
    missing = sorted({f for f in weight_map.values() if f not in headers and not (root / str(f)).is_file()})
    if missing:
        return [f"{root / _INDEX} names files that are not there: {missing[:3]}"]
    wrong = sorted(k for k, f in weight_map.items() if f in headers and k not in headers[f])
    unlisted = sorted(
        k for f, h in headers.items() if f.startswith("model") for k in h if weight_map.get(k) != f
    )
    if wrong or unlisted:
        return [f"{root / _INDEX} does not match the files' headers (e.g. {(wrong or unlisted)[:3]})"]
    return []


def not_a_model_folder(root: Path) -> str:
    """Why ``root``, a folder without a config, is not a model folder, and what to do: a training checkpoint is
    exported, a run folder's checkpoints are named, anything else is asked for the right folder."""
    if is_checkpoint(root):
        return (
            f"{root} is a training checkpoint (sharded DCP files), not an HF model folder; export it first: "
            f"`hf-fsdp2 export {root} OUT_DIR`, then give OUT_DIR"
        )
    checkpoints = sorted(
        (p for p in root.glob("checkpoint-*") if p.name.split("-")[-1].isdigit() and is_checkpoint(p)),
        key=lambda p: int(p.name.split("-")[-1]),
    )
    if checkpoints:
        return (
            f"{root} holds checkpoints but no export (no {CONFIG_NAME}: the run stopped before its end?); export "
            f"the last one: `hf-fsdp2 export {checkpoints[-1]} OUT_DIR`, then give OUT_DIR"
        )
    return (
        f"{root} is not an HF model folder (no {CONFIG_NAME}); give the folder a recipe or `hf-fsdp2 export` wrote "
        "(config.json, weights, tokenizer)"
    )


def is_checkpoint(path: Path) -> bool:
    """A training checkpoint (``checkpoint-<step>``: DCP's ``.metadata`` and ``*.distcp`` shards)."""
    return (path / ".metadata").is_file() or any(path.glob("*.distcp"))


def write_record(folder: Path, *, verified: str | None) -> None:
    """Record in ``folder`` (the staging folder, complete) that its files were verified: each file's size, and
    the verification's summary (None: exported without verification)."""
    files = {
        p.relative_to(folder).as_posix(): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.name.startswith(".")
    }
    record = {"verified": verified, "files": files}
    (folder / RECORD_NAME).write_text(json.dumps(record, indent=2) + "\n")


def record_problem(root: Path, names: list[str]) -> str | None:
    """Why the files ``names`` of ``root`` are not the export its record says was verified, or None.

    Returns:
        A message naming the reason: no record, an export written without verification, or a weight or config
        file that is not the one verified (another size, or not part of the export).
    """
    path = root / RECORD_NAME
    if not path.is_file():
        return (
            f"{root} has no record of a verified export ({RECORD_NAME}: `hf-fsdp2 export`, `merge-adapter` and a "
            "run's own export write it)"
        )
    try:
        record = json.loads(path.read_text())
        verified, files = record["verified"], dict(record["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"{path} is damaged"
    if not verified:
        return f"{root} was exported without verification (--no-verify or export_verify=false)"
    for name in names:
        model_file = name.endswith(".safetensors") or name in _JSON_FILES
        if model_file and name not in files:
            return f"{root / name} is not part of the verified export"
        if model_file and (root / name).stat().st_size != files[name]:
            return (
                f"{root / name} changed after the export verified it "
                f"({files[name]} bytes then, {(root / name).stat().st_size} now)"
            )
    return None
