"""The ``hf-fsdp2`` console command: it only dispatches to the sub-commands that are not training.

Each sub-command's parser (``register_<name>``, which sets ``func`` to the function that runs it) lives beside
its run function in :mod:`hf_fsdp2.commands`; ``SUBCOMMANDS`` lists them in help order. Adding a command means
writing those two functions there and appending the register function to the table. Heavy imports (torch,
transformers) happen inside the run functions so ``hf-fsdp2 --help`` is instant.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from hf_fsdp2.commands import (
    demo,
    doctor,
    eval_harness,
    export,
    plan,
    plot,
    push,
    score,
    show_data,
    train,
    vllm_serve,
)
from hf_fsdp2.commands.common import BadInput, Subparsers, user_error
from hf_fsdp2.methods import method_names
from hf_fsdp2.noise import quiet_foreign_noise

# The sub-command table, in help order.
SUBCOMMANDS: tuple[Callable[[Subparsers], None], ...] = (
    train.register_train,
    demo.register_convert_smollm2,
    demo.register_demo_data,
    demo.register_eval_task,
    demo.register_eval_preference,
    score.register_score,
    eval_harness.register_eval_harness,
    export.register_export,
    export.register_merge_adapter,
    push.register_push,
    show_data.register_show_data,
    plan.register_plan,
    plot.register_plot,
    doctor.register_doctor,
    vllm_serve.register_vllm_serve,
)


def build_parser() -> argparse.ArgumentParser:
    """Build the ``hf-fsdp2`` parser with every sub-command of ``SUBCOMMANDS``.

    Returns:
        The top-level parser; parsed arguments carry ``func``, the sub-command's run function.
    """
    parser = argparse.ArgumentParser(
        prog="hf-fsdp2",
        description="hf_fsdp2: train (accelerate launch of a packaged recipe), and the tools around a run: "
        "asset conversion, demo data, evaluation, export, push, memory plan, plots.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in SUBCOMMANDS:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``hf-fsdp2``.

    Args:
        argv: Arguments without the program name; ``sys.argv[1:]`` when None.

    Returns:
        The process exit status.
    """
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) > 1 and argv[0] == "train" and argv[1] in method_names():
        argv = ["train", "--recipe", argv[1], *argv[2:]]
    args, extra = parser.parse_known_args(argv)
    if extra:
        # Only sub-commands that take recipe overrides (train, show-data, plan) accept arguments they do not declare.
        if not hasattr(args, "overrides"):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    # Results go to stdout (one line, easy to capture in scripts); progress goes to stderr.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    quiet_foreign_noise()
    try:
        return args.func(args)  # type: ignore[no-any-return]
    except (
        FileNotFoundError,
        NotADirectoryError,
        IsADirectoryError,
        PermissionError,
        UnicodeDecodeError,
        BadInput,
    ) as err:
        # A file the user named is missing, of the wrong kind or unreadable: one line (the message names it).
        return user_error(args.command, err)


if __name__ == "__main__":
    sys.exit(main())
