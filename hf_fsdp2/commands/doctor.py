"""``hf-fsdp2 doctor``: the environment, the accelerate config (FSDP1 keys read as FSDP2) and a recipe checked in
seconds, before a run (:mod:`hf_fsdp2.doctor`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_fsdp2.commands.common import Subparsers
from hf_fsdp2.methods import method_names


def _run_doctor(args: argparse.Namespace) -> int:
    from hf_fsdp2.doctor import run_doctor

    # The recipe as the run reads it (its own output_dir: the folder checked is the run's).
    given = args.config is not None or args.overrides
    argv = (["--config", str(args.config)] if args.config else []) + list(args.overrides) if given else None
    report = run_doctor(argv, args.accelerate_config, recipe=args.recipe)
    print(json.dumps(report.as_json()) if args.json else report.text())
    return 1 if report.errors else 0


def register_doctor(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="check the environment, an accelerate config and a recipe before a run (ok / warning / error)",
        description=(
            "In seconds, without training or reading weights: torch / transformers / accelerate / peft against "
            "the declared floors and known upstream bugs, CUDA / NCCL and the GPUs against the processes asked "
            "for, the NCCL_* / TORCH_* debug variables set and what they cost; the accelerate config with each "
            "FSDP1 key read as FSDP2 (or refused with the replacement); the recipe's memory plan against the GPUs, "
            "disk for its checkpoints and export, the output folder, the hub target, the dataset and its format. "
            "One line per finding; exit status 1 on any error."
        ),
    )
    p.add_argument("--config", type=Path, default=None, help="the recipe YAML (as given to recipes/sft.py)")
    p.add_argument(
        "--accelerate_config",
        "--accelerate-config",
        dest="accelerate_config",
        type=Path,
        default=None,
        help="the accelerate config file the run is launched with",
    )
    p.add_argument(
        "--recipe", choices=method_names(), default="sft", help="the recipe the config is for (default: sft)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the lines")
    # Any other --key value pairs are recipe overrides, collected by main() (parse_known_args).
    p.set_defaults(func=_run_doctor, overrides=[])
