"""The metrics file (one JSON record per logged step, and events such as a collapse), the log line, and the
progress bar."""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger("hf_fsdp2")

METRICS_FILE = "metrics.jsonl"


class MetricsWriter:
    """Appends one JSON object per logged optimizer step to ``<output_dir>/metrics.jsonl``.

    Only the main process writes; the others hold a writer that does nothing, so the recipe needs
    no rank checks at its call sites.
    """

    def __init__(self, output_dir: str | Path, *, enabled: bool, resume_step: int | None = None) -> None:
        """Start the file, or on resume keep its records up to ``resume_step`` (later ones are re-run)."""
        self.path = Path(output_dir) / METRICS_FILE
        self.enabled = enabled
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            kept = []
            if resume_step is not None and self.path.is_file():
                kept = [
                    line
                    for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= resume_step
                ]
            self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` (numbers rounded for reading, NaN/inf kept as strings)."""
        if not self.enabled:
            return
        clean = {
            k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in record.items()
        }
        with self.path.open("a") as fh:
            fh.write(json.dumps(clean) + "\n")


def append_metrics_event(output_dir: str | Path, record: dict[str, Any]) -> None:
    """Append an event (a record with ``event`` and ``step``, e.g. a collapse) to ``<output_dir>/metrics.jsonl``
    among the step records, at once (rank 0): a run that stops on it has no later step record to carry it."""
    path = Path(output_dir) / METRICS_FILE
    with path.open("a") as fh:
        fh.write(json.dumps(record) + "\n")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl file, in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def last_metrics(run_dir: Path, up_to_step: int | None = None) -> dict[str, Any] | None:
    """The last step record of a run's metrics.jsonl (at or before ``up_to_step``; events left out), or None."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return None
    rows = [
        r
        for r in read_metrics(path)
        if "event" not in r and (up_to_step is None or r.get("step", 0) <= up_to_step)
    ]
    return rows[-1] if rows else None


def format_duration(seconds: float) -> str:
    """``1h02m``, ``3m05s`` or ``12s``."""
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def format_log_line(record: dict[str, Any], total_steps: int) -> str:
    """The human-readable line printed for a logged step (fields a record lacks are left out)."""
    line = (
        f"step {record['step']}/{total_steps} loss {record['loss']:.4f} lr {record['lr']:.3e} "
        f"grad_norm {record['grad_norm']:.3f} target_tokens {record['target_tokens']} "
        f"tok/s {record['target_tokens_per_s']:.1f} step_time {record['step_time_s']:.2f}s"
    )
    if "tokens_per_s" in record:
        line += f" | all tok/s {record['tokens_per_s']:.1f} ({record['tokens_per_s_per_device']:.1f}/dev)"
    if "mfu" in record:
        line += f" mfu {record['mfu']:.1%}"
    elif "tflops_per_device" in record:
        line += f" {record['tflops_per_device']:.3g} TFLOP/s/dev"
    if "data_wait_s" in record:
        line += f" data_wait {record['data_wait_s']:.3f}s"
    if "padding_efficiency" in record:
        line += f" pad_eff {record['padding_efficiency']:.3f}"
    if "mem_allocated_gib" in record:
        line += f" mem {record['mem_allocated_gib']:.1f}/{record['mem_reserved_gib']:.1f}GiB"
    elif "host_rss_gib" in record:
        line += f" rss {record['host_rss_gib']:.2f}GiB"
    if "eta_s" in record:
        line += f" eta {format_duration(record['eta_s'])}"
    return line


class Progress:
    """tqdm bar on rank 0 when stderr is a terminal; otherwise the log line of each logged step.

    With the bar, log lines of the recipe go through tqdm (they do not break the bar) and each logged
    step's numbers appear in the bar's postfix instead of a line.
    """

    def __init__(
        self, total_steps: int, first_step: int, *, enabled: bool, interactive: bool | None = None
    ) -> None:
        """Args:
        total_steps: last step of the run.
        first_step: first step this process runs (after a resume, > 1).
        enabled: this is the main process.
        interactive: force the bar on or off; None = when stderr is a terminal.
        """
        self.total_steps = total_steps
        interactive = sys.stderr.isatty() if interactive is None else interactive
        self.bar: Any = None
        self._redirect: Any = None
        if enabled and interactive:
            from tqdm.auto import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self.bar = tqdm(total=total_steps, initial=first_step - 1, unit="step", dynamic_ncols=True)
            self._redirect = logging_redirect_tqdm()
            self._redirect.__enter__()
        self.enabled = enabled

    def step(self) -> None:
        """One optimizer step done."""
        if self.bar is not None:
            self.bar.update(1)

    def log(self, record: dict[str, Any]) -> None:
        """Show a logged step: the bar's postfix, or one log line."""
        if not self.enabled:
            return
        if self.bar is None:
            logger.info(format_log_line(record, self.total_steps))
            return
        postfix = {"loss": f"{record['loss']:.4f}", "tok/s": f"{record.get('tokens_per_s', 0.0):.0f}"}
        if "mfu" in record:
            postfix["mfu"] = f"{record['mfu']:.1%}"
        if "eval_loss" in record:
            postfix["eval"] = f"{record['eval_loss']:.4f}"
        self.bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        """Close the bar and give logging back its own handlers."""
        if self.bar is not None:
            self.bar.close()
            self._redirect.__exit__(None, None, None)
            self.bar = None
