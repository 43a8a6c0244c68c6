"""gpu_bench.py's report: each measured runner against the best TRL runner, and the table on stdout."""

from __future__ import annotations

from typing import Any


def add_ratios(results: list[dict[str, Any]]) -> str | None:
    """``x_trl`` on every measured entry: its tokens/s over the best TRL runner's. Returns that runner."""
    trl = [r for r in results if r["runner"] == "trl" and "tokens_per_s" in r]
    if not trl:
        return None
    best = max(trl, key=lambda r: r["tokens_per_s"])
    for r in results:
        if "tokens_per_s" in r:
            r["x_trl"] = r["tokens_per_s"] / best["tokens_per_s"]
    return str(best["name"])


def print_table(report: dict[str, Any]) -> None:
    def num(value: Any, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    print(
        f"\n| runner | tokens/s | target tok/s | step s | TFLOP/s | MFU spec | MFU matmul | max mem GiB "
        f"| final loss | x TRL |\n|{'---|' * 10}"
    )
    for r in report["results"]:
        if "tokens_per_s" not in r:
            why = " ".join(str(r.get("skipped") or r.get("error", "")).split())
            print(f"| {r['name']} | {why[:200]} |")
            continue
        print(
            f"| {r['name']} | {r['tokens_per_s']:,.0f} | {r['target_tokens_per_s']:,.0f} | {r['step_s']:.3f} "
            f"| {r['tflops']:.3g} | {num(r['mfu_vs_spec'], '.1%')} | {num(r['mfu_vs_measured_matmul'], '.1%')} "
            f"| {num(r['max_mem_allocated_gib'], '.1f')} | {r['final_loss']:.4f} "
            f"| {num(r.get('x_trl'), '.2f')} |"
        )
    print(
        f"\nbest TRL runner: {report['trl_baseline']}; wall {report['wall_s']:.0f} s of {report['budget_s']:.0f} s"
    )
