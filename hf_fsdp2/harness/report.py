"""Harness results on disk and on the page: the JSON beside the run, a (before/after) table, the model card section."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS_NAME = "eval_harness.json"
CARD_NAME = "README.md"
# The card's section lies between these markers, so that a new evaluation replaces the old one.
CARD_BEGIN = "<!-- hf_fsdp2:eval-harness -->"
CARD_END = "<!-- /hf_fsdp2:eval-harness -->"


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.4g}"


def results_table(after: dict[str, Any], before: dict[str, Any] | None = None) -> list[str]:
    """A markdown table of the scores (stderrs and item counts left to the JSON), one row per task and metric.

    Args:
        after: :func:`hf_fsdp2.harness.run.run_harness`'s result for the model.
        before: the same for the base model, or None: then a ``before``, ``after`` and ``change`` column.

    Returns:
        The table's lines.
    """
    rows = []
    for task, metrics in after["tasks"].items():
        for metric, value in metrics.items():
            if metric == "n" or metric.endswith("_stderr") or "_stderr," in metric:
                continue
            old = before["tasks"].get(task, {}).get(metric) if before else None
            rows.append((task, metric, old, value, int(metrics.get("n", 0))))
    if before is None:
        lines = ["| task | metric | value | items |", "|---|---|---|---|"]
        return lines + [f"| {t} | {m} | {_fmt(v)} | {n} |" for t, m, _, v, n in rows]
    lines = ["| task | metric | before | after | change | items |", "|---|---|---|---|---|---|"]
    for task, metric, old, value, n in rows:
        change = f"{value - old:+.4g}" if old is not None else ""
        lines.append(f"| {task} | {metric} | {_fmt(old)} | {_fmt(value)} | {change} | {n} |")
    return lines


def results_note(
    results: Path, card: Path | None, after: dict[str, Any], before: dict[str, Any] | None = None
) -> str:
    """The line under the table: where every figure went and how long lm-eval took on each model.

    Args:
        results: the JSON written (:func:`write_results`).
        card: the model card that got the section, or None.
        after: the model's results; before: the base model's, or None.

    Returns:
        ``results: PATH (...); model card: PATH; lm-eval N s on the model (+ M s on the base)``.
    """
    where = f"results: {results} (every metric with its stderr, the items, the settings)"
    if card is not None:
        where += f"; model card: {card}"
    took = f"lm-eval {after['seconds']:.0f} s on the model"
    if before is not None:
        took += f" + {before['seconds']:.0f} s on the base"
    return f"{where}; {took}"


def card_section(after: dict[str, Any], before: dict[str, Any] | None = None) -> str:
    """The model card's benchmark section: the table and how it was measured."""
    s = after["settings"]
    shots = f", {s['num_fewshot']}-shot" if s["num_fewshot"] is not None else ""
    limit = f", first {s['limit']} items per task" if s["limit"] is not None else ""
    how = (
        f"lm-evaluation-harness {after['lm_eval_version']}, {after['backend']} backend, {s['dtype']} on "
        f"{s['device']}, chat template {'on' if s['apply_chat_template'] else 'off'}{shots}{limit}"
    )
    lines = [CARD_BEGIN, "## Benchmarks (lm-evaluation-harness)", ""]
    if before is not None:
        lines += [f"Before: `{before['model']}`; after: this model.", ""]
    lines += results_table(after, before)
    lines += ["", f"Measured with {how} (`hf-fsdp2 eval-harness`; every figure in {RESULTS_NAME}).", CARD_END]
    return "\n".join(lines)


def update_model_card(card: Path, section: str) -> bool:
    """Put ``section`` into the card ``card`` (a README.md), replacing an earlier one; False when there is no card.

    Returns:
        Whether the card was written.
    """
    if not card.is_file():
        return False
    text = card.read_text()
    if CARD_BEGIN in text and CARD_END in text:
        head, rest = text.split(CARD_BEGIN, 1)
        text = head + section + rest.split(CARD_END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    card.write_text(text)
    return True


def write_results(path: Path, after: dict[str, Any], before: dict[str, Any] | None = None) -> Path:
    """The results as JSON at ``path`` (``{"after": ..., "before": ...}``; ``before`` only with a base model).

    Returns:
        ``path``.
    """
    payload: dict[str, Any] = {"after": {k: v for k, v in after.items() if k != "samples"}}
    if before is not None:
        payload["before"] = {k: v for k, v in before.items() if k != "samples"}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path
