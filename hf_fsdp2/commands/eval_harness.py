"""``hf-fsdp2 eval-harness``: lm-evaluation-harness on an export, a LoRA adapter or a checkpoint (:mod:`hf_fsdp2.harness`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_fsdp2.commands.common import Subparsers, user_error


def parse_tasks(value: str) -> list[str]:
    """``a,b, c`` -> ``["a", "b", "c"]`` (empty names dropped)."""
    return [t.strip() for t in value.split(",") if t.strip()]


def _run_eval_harness(args: argparse.Namespace) -> int:
    from hf_fsdp2.export import ExportError
    from hf_fsdp2.harness.evaluate import evaluate_and_report
    from hf_fsdp2.harness.models import HarnessError
    from hf_fsdp2.harness.report import results_note

    chat = {"auto": None, "on": True, "off": False}[args.chat_template]
    try:
        report = evaluate_and_report(
            args.model,
            parse_tasks(args.tasks),
            base=args.base,
            out=args.out,
            export_dir=args.export_dir,
            adapter_base=args.adapter_base,
            backend=args.backend,
            device=args.device,
            dtype=args.dtype,
            batch_size=args.batch_size,
            limit=args.limit,
            num_fewshot=args.num_fewshot,
            chat_template=chat,
            include_path=args.include_path,
            local_items=args.local_items,
        )
    except (HarnessError, ExportError) as err:
        return user_error("eval-harness", err)
    for line in report.table:
        print(line)
    # A person reading the table learns where the rest is; the JSON line stays last, for scripts.
    print(results_note(report.results_path, report.card, report.after, report.before))
    summary = {"results": str(report.results_path), "model_card": str(report.card) if report.card else None}
    summary["tasks"] = report.after["tasks"]  # type: ignore[assignment]
    print(json.dumps(summary))
    return 0


def register_eval_harness(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "eval-harness",
        help="lm-evaluation-harness benchmarks of an export, a LoRA adapter or a checkpoint (before/after with --base)",
        description=(
            "Run lm-evaluation-harness (pip install 'hf_fsdp2[eval]') on MODEL: an export folder, a LoRA adapter "
            "folder (over the base its adapter_config.json names), a checkpoint-<step> folder (exported first, as "
            "`hf-fsdp2 export` does: gather-free, verified) or a hub id. The vLLM backend where vllm imports, "
            "transformers otherwise. Prints a markdown table, a line naming the files written and lm-eval's "
            "seconds, and a JSON line; writes the results as JSON (MODEL/eval_harness.json; beside a checkpoint: "
            "<run>/eval_harness-checkpoint-<step>.json) and a section of MODEL/README.md, the model card. Local tasks that need no hub: hf_fsdp2_dates "
            "(generate_until) and hf_fsdp2_dates_mc (multiple_choice); docs/evaluation-harness.md."
        ),
    )
    p.add_argument(
        "model", metavar="MODEL", help="export folder, adapter folder, checkpoint-<step> folder or hub id"
    )
    p.add_argument(
        "--tasks",
        required=True,
        help="comma list of lm-eval tasks, e.g. hf_fsdp2_dates,hf_fsdp2_dates_mc or "
        "leaderboard_ifeval,arc_challenge (those need the hub)",
    )
    p.add_argument(
        "--base", default=None, help="the model before fine-tuning: a before/after table (same kinds)"
    )
    p.add_argument("--limit", type=int, default=None, help="first N items of each task (default: all)")
    p.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: each task's)")
    p.add_argument("--batch-size", type=int, default=8, help="requests per forward (default: 8)")
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda when a GPU is visible)")
    p.add_argument(
        "--dtype", default="auto", help="weights' dtype (default auto: float32 on CPU, the config's on a GPU)"
    )
    p.add_argument(
        "--backend",
        choices=["auto", "hf", "vllm"],
        default="auto",
        help="auto: vllm where it imports, else hf",
    )
    p.add_argument(
        "--chat-template",
        choices=["auto", "on", "off"],
        default="auto",
        help="render prompts with the tokenizer's chat template (auto: when it has one)",
    )
    p.add_argument("--include-path", type=Path, default=None, help="a folder of your own lm-eval task YAMLs")
    p.add_argument(
        "--local-items", type=int, default=8, help="items of each local hf_fsdp2_* task (default: 8)"
    )
    p.add_argument(
        "--out", type=Path, default=None, help="results JSON path (default: beside the model, above)"
    )
    p.add_argument(
        "--export-dir",
        type=Path,
        default=None,
        help="keep a checkpoint's export here (default: a hidden folder in its run, removed after)",
    )
    p.add_argument(
        "--adapter-base", default=None, help="an adapter's base model, instead of the one it names"
    )
    p.set_defaults(func=_run_eval_harness)
