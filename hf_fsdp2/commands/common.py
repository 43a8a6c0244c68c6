"""What the sub-commands share: the type their parsers are added to, the exit of bad input, and the recipe
argv of the commands that read a recipe without running it (``show-data``, ``plan``)."""

from __future__ import annotations

import argparse
import os
import sys

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
