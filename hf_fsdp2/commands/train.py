"""``hf-fsdp2 train [METHOD]``: a training method (:mod:`hf_fsdp2.methods`) through accelerate launch
(:mod:`hf_fsdp2.launch`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_fsdp2.commands.common import Subparsers, user_error
from hf_fsdp2.methods import method_names


def _run_train(args: argparse.Namespace) -> int:
    from hf_fsdp2.launch import run_train

    if args.config is not None and not Path(args.config).is_file():
        return user_error("train", FileNotFoundError(f"--config {args.config}: no such file"))
    recipe_args = ([f"--config={args.config}"] if args.config else []) + list(args.overrides)
    try:
        return run_train(
            args.recipe,
            recipe_args,
            config_file=args.config_file,
            num_processes=args.num_processes,
            num_machines=args.num_machines,
            machine_rank=args.machine_rank,
            main_process_ip=args.main_process_ip,
            main_process_port=args.main_process_port,
        )
    except (FileNotFoundError, ValueError) as err:
        return user_error("train", err)


def register_train(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        help=f"train with a recipe ({', '.join(method_names())}) on every local device through accelerate launch",
        description=(
            f"hf-fsdp2 train [{'|'.join(method_names())}] --config r.yaml [--key value ...] runs a packaged recipe with accelerate launch: the packaged FSDP2 accelerate config with one process "
            "per GPU, or the CPU (gloo) config with 2 processes on a machine without a GPU. Any recipe key "
            "follows: hf-fsdp2 train --config r.yaml --learning_rate 1e-5. Multi-node: run the same command on "
            "every machine with --num_machines, --machine_rank and --main_process_ip."
        ),
    )
    # `hf-fsdp2 train dpo --config ...` (as `trl dpo`): main() turns a leading recipe name into --recipe.
    p.add_argument("--recipe", default="sft", choices=method_names(), help="the recipe (default sft)")
    p.add_argument("--config", default=None, help="the recipe YAML")
    p.add_argument(
        "--config_file", default=None, help="an accelerate config file (default: the packaged one)"
    )
    p.add_argument(
        "--num_processes", type=int, default=None, help="processes in all (default: local GPUs, or 2 on CPU)"
    )
    p.add_argument("--num_machines", type=int, default=1, help="machines of a multi-node run (default 1)")
    p.add_argument("--machine_rank", type=int, default=0, help="this machine's rank (0 on the main one)")
    p.add_argument("--main_process_ip", default=None, help="address of machine rank 0 (multi-node)")
    p.add_argument("--main_process_port", type=int, default=None, help="its port (default: accelerate's)")
    # Any other --key value pairs are recipe keys, collected by main() (parse_known_args).
    p.set_defaults(func=_run_train, overrides=[])
