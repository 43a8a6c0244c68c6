"""``hf-fsdp2 eval-harness`` as a function: resolve the model (and the base), run lm-eval, write the JSON and the
card. The command, a recipe's ``eval_harness_tasks`` and the demo call it."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_fsdp2.harness.models import EvalModel, is_checkpoint, resolve_model
from hf_fsdp2.harness.report import (
    CARD_NAME,
    RESULTS_NAME,
    card_section,
    results_table,
    update_model_card,
    write_results,
)
from hf_fsdp2.harness.run import require_lm_eval, run_harness

logger = logging.getLogger("hf_fsdp2")


@dataclass(kw_only=True)
class HarnessReport:
    """What one evaluation produced.

    Attributes:
        after: the model's results (:func:`hf_fsdp2.harness.run.run_harness`).
        before: the base model's, or None.
        results_path: the JSON written.
        card: the model card that got the section, or None (no card: a hub id, or a checkpoint's temporary export).
        table: the markdown table's lines.
    """

    after: dict[str, Any]
    before: dict[str, Any] | None
    results_path: Path
    card: Path | None
    table: list[str] = field(default_factory=list)


def default_results_path(name: str | Path) -> Path:
    """Where the JSON goes: in an export or adapter folder; beside a checkpoint, in its run folder
    (``eval_harness-checkpoint-<step>.json``); for a hub id, in the current folder."""
    path = Path(name).expanduser()
    if is_checkpoint(path):
        return path.parent / f"eval_harness-{path.name}.json"
    return path / RESULTS_NAME if path.is_dir() else Path(RESULTS_NAME)


def _resolve(
    name: str | Path, export_dir: Path | None, adapter_base: str | None, temporary: list[Path]
) -> EvalModel:
    path = Path(name).expanduser()
    if is_checkpoint(path) and export_dir is None:
        # A hidden folder in the run (the push skips it), on the disk that holds the checkpoints; removed after.
        export_dir = path.parent / f".eval-harness-export-{path.name}"
        shutil.rmtree(export_dir, ignore_errors=True)  # a crashed evaluation's leftover
        temporary.append(export_dir)
    return resolve_model(name, export_dir=export_dir, adapter_base=adapter_base)


def evaluate_and_report(
    name: str | Path,
    tasks: list[str],
    *,
    base: str | Path | None = None,
    out: Path | None = None,
    export_dir: Path | None = None,
    adapter_base: str | None = None,
    **run_kwargs: Any,
) -> HarnessReport:
    """Evaluate ``name`` (and ``base``, with the same settings) on ``tasks``; write the JSON and the card section.

    Args:
        name: an export folder, a LoRA adapter folder, a ``checkpoint-<step>`` folder or a hub id.
        tasks: lm-eval task names.
        base: the model before fine-tuning, for a before/after table (any of the kinds of ``name``).
        out: the JSON's path (default :func:`default_results_path`).
        export_dir: where a checkpoint is exported and kept (default: a temporary folder in its run, removed after).
        adapter_base: an adapter's base, instead of the one its config names.
        **run_kwargs: :func:`hf_fsdp2.harness.run.run_harness`'s settings (backend, device, dtype, limit, ...).

    Returns:
        The report.

    Raises:
        HarnessError: bad input (the message names the value and the fix).
        ExportError: a checkpoint's export failed.
    """
    require_lm_eval()  # before any export: a missing package is said first
    temporary: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="hf_fsdp2-harness-") as tmp:
        try:
            model = _resolve(name, export_dir, adapter_base, temporary)
            after = run_harness(model, tasks, work_dir=Path(tmp), **run_kwargs)
            before = None
            if base is not None:
                before = run_harness(
                    _resolve(base, None, None, temporary), tasks, work_dir=Path(tmp), **run_kwargs
                )
        finally:
            for folder in temporary:
                shutil.rmtree(folder, ignore_errors=True)
    results = write_results(out or default_results_path(name), after, before)
    card = model.folder / CARD_NAME if model.folder is not None and model.folder.is_dir() else None
    if card is not None and not update_model_card(card, card_section(after, before)):
        card = None
    return HarnessReport(
        after=after, before=before, results_path=results, card=card, table=results_table(after, before)
    )


# The launcher's and accelerate's variables: without them the evaluation is one plain process (lm-eval would otherwise
# build an Accelerator for the run's world size and wait for ranks that have ended).
_LAUNCH_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)
_LAUNCH_PREFIXES = ("TORCHELASTIC_", "ACCELERATE_", "FSDP_")


def evaluate_after_export(folder: Path, tasks: str, *, limit: int | None = None) -> dict[str, Any] | None:
    """A recipe's ``eval_harness_tasks``: ``hf-fsdp2 eval-harness`` on the run's verified export (rank 0, once the
    other ranks are released), in a process of its own without the launcher's environment. A failure is logged with
    the command that reruns it, and never touches the export.

    Args:
        folder: the run's export folder (``output_dir``; a LoRA run's adapter is evaluated over its base).
        tasks: comma-separated lm-eval task names.
        limit: items per task (None: all).

    Returns:
        The command's JSON line (``results``, ``model_card``, ``tasks``), or None when the evaluation failed.
    """
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    argv = [
        "eval-harness",
        str(folder),
        "--tasks",
        ",".join(names),
        *(["--limit", str(limit)] if limit else []),
    ]
    rerun = "hf-fsdp2 " + " ".join(argv)
    env = {
        k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith(_LAUNCH_PREFIXES)
    }
    logger.info("eval_harness_tasks: %s", rerun)
    # stderr (lm-eval's progress, an error's line) goes to the run's log as it comes; stdout is the table + JSON.
    done = subprocess.run(
        [sys.executable, "-m", "hf_fsdp2.cli", *argv], env=env, stdout=subprocess.PIPE, text=True
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        logger.error(
            "eval_harness_tasks: the evaluation failed (exit status %d; its error is above); the export in %s is "
            "complete and unchanged. Rerun the evaluation with: %s",
            done.returncode,
            folder,
            rerun,
        )
        return None
    for line in lines[:-1]:  # the table, then the line naming the results' JSON and the card
        logger.info("eval-harness %s", line)
    result: dict[str, Any] = json.loads(lines[-1])
    return result
