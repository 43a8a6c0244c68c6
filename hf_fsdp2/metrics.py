"""Per-step metrics: the JSONL file every run writes, and the log line."""

from __future__ import annotations

import json
import logging
import math
import time
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


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl file, in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def format_log_line(record: dict[str, Any], total_steps: int) -> str:
    """The human-readable line printed for a logged step."""
    return (
        f"step {record['step']}/{total_steps} loss {record['loss']:.4f} lr {record['lr']:.3e} "
        f"grad_norm {record['grad_norm']:.3f} target_tokens {record['target_tokens']} "
        f"tok/s {record['target_tokens_per_s']:.1f} step_time {record['step_time_s']:.2f}s"
    )


class StepTimer:
    """Wall time of one optimizer step."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def lap(self) -> float:
        """Seconds since the last lap (or creation), and restart."""
        now = time.perf_counter()
        elapsed, self.start = now - self.start, now
        return elapsed
