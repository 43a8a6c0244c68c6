"""Experiment trackers through accelerate (tensorboard, wandb, trackio): checked installed before any work."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger("hf_fsdp2")

TRACKERS = ("tensorboard", "wandb", "trackio")
_TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}


def parse_report_to(report_to: str) -> tuple[str, ...]:
    """``none``, ``all`` or a comma list of tensorboard, wandb, trackio -> the names asked for.

    ``all`` stays ``("all",)``: which trackers it means depends on what is installed (see
    :func:`build_trackers`).

    Raises:
        ValueError: an unknown name, or none/all mixed with names.
    """
    names = tuple(dict.fromkeys(n.strip().lower() for n in report_to.split(",") if n.strip()))
    if names in ((), ("none",)):
        return ()
    if names == ("all",):
        return names
    unknown = [n for n in names if n not in TRACKERS]
    if unknown or "none" in names or "all" in names:
        raise ValueError(
            f"report_to={report_to!r}: use none, all, or a comma list of {', '.join(TRACKERS)} "
            f"(unknown: {', '.join(unknown) or 'none/all mixed with names'})"
        )
    return names


def _installed(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


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
    if names == ("all",):
        names = tuple(n for n in TRACKERS if _installed(_TRACKER_PACKAGES[n]))
        if not names:
            raise ValueError(
                "report_to=all but none of tensorboard, wandb, trackio is installed; "
                "pip install tensorboard (or wandb, trackio), or set report_to=none"
            )
        logger.info("report_to=all: %s", ", ".join(names))
    missing = [n for n in names if not _installed(_TRACKER_PACKAGES[n])]
    if missing:
        raise ValueError(
            f"report_to={report_to!r} needs {', '.join(missing)}, which is not installed: "
            f"pip install {' '.join(_TRACKER_PACKAGES[n] for n in missing)} (or drop it from report_to)"
        )
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
