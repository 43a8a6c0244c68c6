"""`hf-fsdp2 plot RUN_DIR`: one PNG per panel from a run's metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

from hf_fsdp2.observe.logs import METRICS_FILE

# One PNG per panel: (file name, title, y label, [(record key, legend label)]).
PLOTS: tuple[tuple[str, str, str, tuple[tuple[str, str], ...]], ...] = (
    ("loss.png", "Loss", "cross entropy", (("loss", "train loss"), ("eval_loss", "eval loss"))),
    (
        "throughput.png",
        "Throughput",
        "tokens / s (global)",
        (("tokens_per_s", "all tokens"), ("target_tokens_per_s", "target tokens")),
    ),
    (
        "memory.png",
        "Peak memory",
        "GiB (max over ranks)",
        (
            ("mem_allocated_gib", "CUDA allocated"),
            ("mem_reserved_gib", "CUDA reserved"),
            ("host_peak_rss_gib", "host peak RSS"),
        ),
    ),
    ("lr.png", "Learning rate", "lr", (("lr", "lr"),)),
)


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """PNG plots of a run's metrics.jsonl: loss (+ eval loss), tokens/s, memory, learning rate.

    Args:
        run_dir: the run's output_dir (holding metrics.jsonl).
        out_dir: where to write the PNGs (default ``run_dir/plots``).

    Returns:
        The PNG files written (a panel without any data is skipped).

    Raises:
        FileNotFoundError: no metrics.jsonl in ``run_dir``.
        ValueError: the file holds no record, or matplotlib is not installed.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; give the output_dir of a run")
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # the line a running job is writing
    if not records:
        raise ValueError(f"{path} holds no record yet")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ValueError("hf-fsdp2 plot needs matplotlib: pip install matplotlib") from err
    target = Path(out_dir) if out_dir is not None else Path(run_dir) / "plots"
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for filename, title, ylabel, series in PLOTS:
        fig, ax = plt.subplots(figsize=(7, 4))
        drawn = False
        for key, label in series:
            points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), int | float)]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o" if len(points) < 30 else None, label=label)
                drawn = True
        if drawn:
            ax.set(title=title, xlabel="step", ylabel=ylabel)
            ax.grid(alpha=0.3)
            ax.legend()
            fig.tight_layout()
            fig.savefig(target / filename, dpi=100)
            written.append(target / filename)
        plt.close(fig)
    return written
