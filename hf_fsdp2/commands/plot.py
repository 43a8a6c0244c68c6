"""``hf-fsdp2 plot``: PNG plots of a run's metrics.jsonl (:mod:`hf_fsdp2.observe.plot`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_fsdp2.commands.common import Subparsers, user_error


def _run_plot(args: argparse.Namespace) -> int:
    from hf_fsdp2.observe.plot import plot_run

    try:
        written = plot_run(args.run_dir, args.out_dir)
    except (FileNotFoundError, ValueError) as err:
        return user_error("plot", err)
    print(json.dumps({"plots": [str(p) for p in written]}))
    return 0


def register_plot(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "plot",
        help="write PNG plots (loss and eval loss, tokens/s, memory, lr) of a run's metrics.jsonl",
        description=(
            "Read RUN_DIR/metrics.jsonl and write loss.png (train and eval loss), throughput.png (tokens/s), "
            "memory.png (peak memory) and lr.png to RUN_DIR/plots (or --out-dir) with matplotlib."
        ),
    )
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run's output_dir")
    p.add_argument("--out-dir", type=Path, default=None, help="folder of the PNGs (default: RUN_DIR/plots)")
    p.set_defaults(func=_run_plot)
