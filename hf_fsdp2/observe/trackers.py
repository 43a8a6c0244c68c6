"""Experiment trackers through accelerate (tensorboard, wandb, trackio): checked installed before any work."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hf_fsdp2.config import plans
from hf_fsdp2.config.plans import TRACKERS, parse_report_to

logger = logging.getLogger("hf_fsdp2")


def build_trackers(report_to: str, log_dir: str | Path, *, project: str, run_name: str) -> list[Any]:
    """Accelerate trackers for ``report_to``, ready to pass as ``Accelerator(log_with=...)``.

    Args:
        report_to: the config value (see :func:`parse_report_to`); ``all`` = every one installed.
        log_dir: folder of local logs (TensorBoard events go to ``log_dir/run_name``).
        project: wandb / trackio project.
        run_name: the run's name in every tracker.

    Returns:
        ``GeneralTracker`` instances (empty for ``none``); accelerate starts them in ``init_trackers``.

    Raises:
        ValueError: a named tracker is not installed (the message gives the pip command), or ``all``
            finds none installed.
    """
    from accelerate.tracking import TensorBoardTracker, TrackioTracker, WandBTracker

    names = parse_report_to(report_to)
    plans.check_trackers_installed(names)
    if names == ("all",):
        names = tuple(n for n in TRACKERS if plans.tracker_installed(n))
        logger.info("report_to=all: %s", ", ".join(names))
    trackers: list[Any] = []
    for name in names:
        if name == "tensorboard":
            trackers.append(TensorBoardTracker(run_name, str(log_dir)))
        elif name == "wandb":
            trackers.append(WandBTracker(project, name=run_name, dir=str(log_dir)))
        else:
            trackers.append(TrackioTracker(project, name=run_name))
    return trackers


def tracker_values(record: Mapping[str, Any]) -> dict[str, int | float | str]:
    """The numbers of a record (not the step itself) for ``accelerator.log``."""
    return {
        k: v
        for k, v in record.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
    }


def tracker_config(flat_config: Mapping[str, Any]) -> dict[str, Any]:
    """The run's config as trackers accept it: lists joined, None as an empty string, secrets left out."""
    out: dict[str, Any] = {}
    for key, value in flat_config.items():
        if "token" in key:
            continue
        if isinstance(value, list | tuple):
            value = ",".join(map(str, value))
        out[key] = "" if value is None else value
    return out
