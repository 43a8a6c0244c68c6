"""The run summary: throughput, MFU, memory, compile time and the last eval, logged and written as JSON."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hf_fsdp2.observe.logs import format_duration
from hf_fsdp2.observe.meter import StepMeter

SUMMARY_FILE = "summary.json"


def run_summary(
    meter: StepMeter,
    *,
    first_step: int,
    last_step: int,
    wall_seconds: float,
    last_record: Mapping[str, Any] | None,
    last_eval: Mapping[str, Any] | None,
    export_dir: str | Path | None,
    compile_stats: Mapping[str, float] | None = None,
    learned_nothing: Sequence[Mapping[str, Any]] = (),
    restarts: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """What the run did, for the log and ``summary.json``.

    Args:
        meter: the loop's meter (its totals over the logged intervals).
        first_step: first step this process ran.
        last_step: last step it ran.
        wall_seconds: time from the start of the recipe to now.
        last_record: the last metrics record (final training loss), or None.
        last_eval: the last eval results (``eval_loss``, ``eval_perplexity``), or None.
        export_dir: where the consolidated HF folder went, or None.
        compile_stats: with torch.compile, ``compile_s`` (seconds compiling inside the steps, rank 0),
            ``compiled_graphs``, ``recompiles`` and ``recompile_limit_hits``. The summary's tokens/s, TFLOP/s
            and MFU then leave the compile seconds out of the step time (``wall_time_s`` and ``train_time_s``
            keep them); ``tokens_per_s_including_compile`` gives the rate with them.
        learned_nothing: the run's collapses and steps without a learning signal (``on_collapse: warn``; the
            records of :class:`hf_fsdp2.train.nonfinite.Finding`); an empty list when there were none.
        restarts: the run's restarts (``restarts.json``: each one's cause, step and steps lost); empty: none.

    Returns:
        A JSON-ready dict.
    """
    t = meter.totals
    extra: dict[str, Any] = {}
    compile_s = 0.0
    if compile_stats is not None:
        compile_s = float(compile_stats.get("compile_s", 0.0))
        extra = {
            "compile_time_s": compile_s,
            "compiled_graphs": int(compile_stats.get("compiled_graphs", 0)),
            "recompiles": int(compile_stats.get("recompiles", 0)),
            "recompile_limit_hits": int(compile_stats.get("recompile_limit_hits", 0)),
            "compile_outside_steps_s": float(compile_stats.get("compile_outside_steps_s", 0.0)),
            # The rates below leave the compile time out; this one keeps it, for comparison.
            "tokens_per_s_including_compile": meter.mean_throughput()["tokens_per_s"],
            # A compile time not below the step time cannot be taken off (it was not all inside the steps).
            "throughput_excludes_compile": 0 <= compile_s < t["step_time_s"],
        }
    return {
        "steps": last_step - first_step + 1 if last_step >= first_step else 0,
        "first_step": first_step,
        "last_step": last_step,
        "tokens": int(t["tokens"]),
        "target_tokens": int(t["target_tokens"]),
        "wall_time_s": wall_seconds,
        "train_time_s": t["step_time_s"],
        "data_wait_s": t["data_wait_s"],
        # tokens/s, TFLOP/s and MFU of training itself: compile seconds (inside the first steps) left out.
        **meter.mean_throughput(exclude_seconds=compile_s),
        "peak_memory_gib": t["peak_memory_gib"],
        "peak_memory_kind": "cuda_allocated" if meter.device.type == "cuda" else "host_rss",
        "world_size": meter.world_size,
        "final_loss": last_record.get("loss") if last_record else None,
        "final_eval_loss": last_eval.get("eval_loss") if last_eval else None,
        "final_eval_perplexity": last_eval.get("eval_perplexity") if last_eval else None,
        "final_eval_accuracy": last_eval.get("eval_rewards/accuracies") if last_eval else None,
        "export_dir": str(export_dir) if export_dir is not None else None,
        "learned_nothing": [dict(f) for f in learned_nothing],
        "restarts": [dict(r) for r in restarts],
        "steps_lost_to_restarts": sum(int(r.get("steps_lost") or 0) for r in restarts),
        **extra,
    }


def format_summary(summary: Mapping[str, Any]) -> list[str]:
    """Log lines of a :func:`run_summary`."""
    mfu = summary.get("mfu")
    lines = [
        f"summary: {summary['steps']} steps ({summary['first_step']}..{summary['last_step']}) in "
        f"{format_duration(summary['wall_time_s'])} wall, {format_duration(summary['train_time_s'])} in steps "
        f"({format_duration(summary['data_wait_s'])} waiting for data)",
        f"summary: {summary['tokens']} tokens ({summary['target_tokens']} target) at "
        f"{summary['tokens_per_s']:.1f} tok/s ({summary['tokens_per_s_per_device']:.1f} per device), "
        f"{summary['tflops_per_device']:.3g} TFLOP/s per device"
        + (f", MFU {mfu:.1%}" if mfu is not None else " (no MFU: unknown peak; set peak_flops)"),
        f"summary: peak memory {summary['peak_memory_gib']:.2f} GiB ({summary['peak_memory_kind']}, max over ranks)",
    ]
    if summary.get("compile_time_s") is not None:
        lines.append(
            f"summary: torch.compile {format_duration(summary['compile_time_s'])} compiling inside the steps, "
            f"{summary['compiled_graphs']} graphs, {summary['recompiles']} recompiles"
            + (
                f", recompile limit hit {summary['recompile_limit_hits']} time(s) (that code ran eagerly)"
                if summary.get("recompile_limit_hits")
                else ""
            )
            + "; the rates above "
            + ("leave the compile time out" if summary.get("throughput_excludes_compile") else "include it")
            + f" ({summary['tokens_per_s_including_compile']:.1f} tok/s with it)"
        )
    losses = []
    if summary.get("final_loss") is not None:
        losses.append(f"final loss {summary['final_loss']:.4f}")
    if summary.get("final_eval_loss") is not None:
        detail = (
            f"perplexity {summary['final_eval_perplexity']:.3f}"
            if summary.get("final_eval_perplexity") is not None
            else f"preference accuracy {summary['final_eval_accuracy']:.3f}"
            if summary.get("final_eval_accuracy") is not None
            else ""
        )
        losses.append(f"eval loss {summary['final_eval_loss']:.4f}" + (f" ({detail})" if detail else ""))
    if losses:
        lines.append("summary: " + ", ".join(losses))
    for finding in summary.get("learned_nothing") or ():
        lines.append(
            f"summary: LEARNED NOTHING at steps {finding['first_step']}..{finding['step']} ({finding['kind']}; "
            "on_collapse: warn): the export holds a model that stopped learning there"
        )
    restarts = summary.get("restarts") or ()
    if restarts:
        lines.append(
            f"summary: restarted {len(restarts)} time(s), {summary.get('steps_lost_to_restarts', 0)} step(s) trained "
            "again; causes in restarts.json: "
            + "; ".join(f"step {r.get('step')}: {r.get('cause')}" for r in restarts)
        )
    lines.append(
        f"summary: export in {summary['export_dir']}" if summary.get("export_dir") else "summary: no export"
    )
    return lines


def write_summary(summary: Mapping[str, Any], output_dir: str | Path) -> Path:
    """Write ``<output_dir>/summary.json``; returns its path."""
    path = Path(output_dir) / SUMMARY_FILE
    path.write_text(json.dumps(dict(summary), indent=2) + "\n")
    return path
