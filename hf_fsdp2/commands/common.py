"""What the sub-commands share: the type their parsers are added to, the exit of bad input, the one check of
a model folder (or hub id) that every command taking a model runs before it loads anything, the reading of a
JSON-lines file, and the recipe argv of the commands that read a recipe without running it (``show-data``,
``plan``)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

# argparse has no public name for what add_subparsers returns; every register function takes one.
Subparsers = argparse._SubParsersAction


def user_error(command: str, err: Exception) -> int:
    """Bad input: one clear line on stderr and exit status 2 (HF_FSDP2_DEBUG=1 shows the traceback)."""
    if os.environ.get("HF_FSDP2_DEBUG"):
        raise err
    print(f"hf-fsdp2 {command}: error: {err}", file=sys.stderr)
    return 2


def recipe_argv(args: argparse.Namespace) -> list[str]:
    """The recipe's argv from ``--config`` and the overrides ``main`` collected: ``output_dir`` is required by a
    recipe but unused by a command that does not train, so a placeholder keeps recipes without it working."""
    return (["--config", str(args.config)] if args.config else []) + [
        *args.overrides,
        "--output_dir",
        "unused",
    ]


class BadInput(ValueError):
    """A file or folder the user named cannot be used; the message names it and the fix (one line, exit 2)."""


def _hub_shaped(name: str) -> bool:
    """``org/name`` that is no local path: the only form the commands hand to the hub."""
    if name.startswith((".", "/", "~")) or name.count("/") != 1 or Path(name).expanduser().exists():
        return False
    from hf_fsdp2.config.plans import repo_id_problem

    return repo_id_problem(name) is None


def model_path(value: str | Path, *, what: str, hub: bool = True) -> str:
    """The one check of a model argument, before anything loads: a local HF model folder whose config and
    weight headers are sound, or (``hub``) an ``org/name`` hub id when the hub can be reached or the id is in
    the local cache. A training checkpoint, a run folder without an export, a damaged or missing folder: one
    line naming the path and the fix, in well under a second (no hub retries).

    Args:
        value: the argument as given.
        what: how the command names it (``MODEL_DIR``, ``--model``), for the message.
        hub: accept a hub id (``org/name``) that is not a local path.

    Returns:
        The path (``~`` expanded) or the hub id, for ``from_pretrained``.

    Raises:
        BadInput: the message names the path, what is wrong and what to give instead.
    """
    from hf_fsdp2.export.folder import folder_problems

    name = str(value)
    path = Path(name).expanduser()
    if path.is_dir():
        problems = folder_problems(path)
        if problems:
            fix = (
                ""
                if "hf-fsdp2 export" in problems[0] or "not an HF model folder" in problems[0]
                else (
                    "; restore the file from a copy, or export the checkpoint again (`hf-fsdp2 export CHECKPOINT OUT_DIR`)"
                )
            )
            raise BadInput(f"{what} {problems[0]}{fix}")
        return str(path)
    if path.exists():
        raise BadInput(f"{what} {name} is a file, not an HF model folder (config.json, weights, tokenizer)")
    if hub and _hub_shaped(name):
        from huggingface_hub import constants, try_to_load_from_cache

        if not constants.is_offline_mode() or isinstance(try_to_load_from_cache(name, "config.json"), str):
            return name
        raise BadInput(
            f"{what} {name}: no such folder, and HF_HUB_OFFLINE=1 keeps it from being fetched as a hub id (it is not "
            "in the local hub cache); give an existing folder, or unset HF_HUB_OFFLINE to download it"
        )
    ids = " or a hub id like org/name" if hub else ""
    raise BadInput(
        f"{what} {name}: no such folder; give an HF model folder (config.json, weights, tokenizer: a recipe's export "
        f"or `hf-fsdp2 export`'s OUT_DIR){ids}"
    )


def read_records(path: Path, what: str) -> list[dict[str, Any]]:
    """The records of a JSON-lines file, or one line naming the file (and the line) when it cannot be read.

    Raises:
        BadInput: missing, not a text file, or a line that is not a JSON object.
    """
    from hf_fsdp2.demo.tasks import read_jsonl

    if path.is_dir():
        raise BadInput(f"{what} {path} is a folder, not a JSON-lines file")
    try:
        records = read_jsonl(path)
    except UnicodeDecodeError as err:
        raise BadInput(
            f"{what} {path} is not a text file (byte {err.start}: not UTF-8); give a JSON-lines file, one record "
            "per line"
        ) from None
    except (FileNotFoundError, ValueError) as err:
        raise BadInput(f"{what}: {err}") from None
    for i, record in enumerate(records, start=1):
        if not isinstance(record, dict):
            raise BadInput(f"{what} {path}: record {i} is a JSON {type(record).__name__}, not an object")
    return records


def load_failed(what: str, source: str, err: Exception) -> BadInput:
    """A model folder that passed :func:`model_path` but still failed to load: its first line, and the fix."""
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return BadInput(
        f"{what} {source} cannot be loaded ({type(err).__name__}: {first}); restore its files from a copy or "
        "export the checkpoint again (`hf-fsdp2 export CHECKPOINT OUT_DIR`)"
    )
