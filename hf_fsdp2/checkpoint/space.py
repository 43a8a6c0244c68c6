"""Disk space for a run's checkpoints and export: what they take (estimated from the model's parameters, their
dtypes and AdamW's two moments per trained parameter), checked against the free space of the run folder's disk
before the first step, and named when a save runs out of it.

A checkpoint holds every parameter in its training dtype plus, for each trained parameter, AdamW's ``exp_avg``
and ``exp_avg_sq`` in the same dtype; RNG files, the config and the index are a few KB. The export holds every
parameter in ``export_dtype``.
"""

from __future__ import annotations

import errno
import logging
import shutil
from pathlib import Path

import torch

logger = logging.getLogger("hf_fsdp2")

EXPORT_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
ADAM_MOMENTS = 2


def size_text(n: float) -> str:
    """``1.50 GiB``, ``12.3 MiB``, ``512 B``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "GiB" else f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def checkpoint_bytes(model: torch.nn.Module) -> int:
    """About how many bytes one checkpoint of ``model`` (and its AdamW state) takes, over all ranks.

    ``numel`` of a sharded (DTensor) parameter is its global size, so every rank gets the same figure.
    """
    total = 0
    for p in model.parameters():
        size = p.numel() * p.element_size()
        total += size * (1 + (ADAM_MOMENTS if p.requires_grad else 0))
    return total


def export_bytes(model: torch.nn.Module, export_dtype: str) -> int:
    """About how many bytes the consolidated export takes (``export_dtype``; ``training``: the weights' dtypes)."""
    per = EXPORT_DTYPE_BYTES.get(export_dtype)
    return sum(p.numel() * (per or p.element_size()) for p in model.parameters())


def planned_checkpoints(first_step: int, total_steps: int, save_steps: int, keep_last: int) -> int:
    """How many checkpoints exist at once at most: those the run writes, bounded by ``save_total_limit``
    (plus the new one, written before the oldest is removed)."""
    if save_steps <= 0 or total_steps < first_step:
        return 0
    steps = {s for s in range(first_step, total_steps + 1) if s % save_steps == 0} | {total_steps}
    return len(steps) if keep_last <= 0 else min(len(steps), keep_last + 1)


def free_bytes(path: Path) -> int:
    """Free bytes on the disk that holds ``path`` (or its nearest existing parent)."""
    path = path.resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def check_disk_space(
    output_dir: Path, *, checkpoint: int, checkpoints: int, export: int, free: int | None = None
) -> tuple[str | None, str | None]:
    """Check the run folder's disk can hold what the run writes.

    Args:
        output_dir: the run folder.
        checkpoint: bytes of one checkpoint.
        checkpoints: how many exist at once at most (0: no periodic checkpoint; one is still written when the
            export fails, to keep the trained weights).
        export: bytes of the export.
        free: the free bytes (measured when None).

    Returns:
        ``(error, warning)``: the error when not even the first thing the run must write fits (one checkpoint, or
        without periodic checkpoints the export); the warning when everything it plans does not. Each names both
        sizes and the folder; None when there is nothing to say.
    """
    free = free_bytes(output_dir) if free is None else free
    first, what = (checkpoint, "one checkpoint") if checkpoints else (export, "the export")
    if free < first:
        return (
            f"not enough disk space for output_dir={str(output_dir)!r}: {size_text(free)} free, {what} needs about "
            f"{size_text(first)} (parameters and AdamW state); free space or choose an output_dir on a larger disk",
            None,
        )
    planned = checkpoint * max(checkpoints, 1) + export
    if free < planned:
        kept = f"{checkpoints} checkpoint(s)" if checkpoints else "1 checkpoint (written if the export fails)"
        return None, (
            f"output_dir={str(output_dir)!r} has {size_text(free)} free, but the run plans about {size_text(planned)}: "
            f"{kept} of about {size_text(checkpoint)} each + the export of about {size_text(export)}; the run may "
            "run out of space: lower save_total_limit, raise save_steps, or free space"
        )
    return None, None


def says_out_of_space(error_text: str) -> bool:
    """Whether a failure's text (one rank's error, or DCP's report of every rank's traceback) is ENOSPC."""
    return "No space left" in error_text or f"Errno {errno.ENOSPC}" in error_text


def folder_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 when it is missing; files removed while it is read are skipped)."""
    total = 0
    for item in path.rglob("*") if path.is_dir() else ():
        try:
            total += item.stat().st_size if item.is_file() else 0
        except OSError:
            continue
    return total


def out_of_space_note(output_dir: Path, needed: int, error_text: str) -> str:
    """A clause naming a full disk as the cause of a failed write, or "" when the disk has room.

    A write that runs out of space often surfaces as a library's own error (``unexpected pos``), so the free
    space left (after the partial write was removed) is compared with what one checkpoint needs.
    """
    free = free_bytes(output_dir)
    if says_out_of_space(error_text) or (needed and free < needed):
        return (
            f"the disk of {output_dir} is full (ENOSPC, no space left on device): {size_text(free)} free, a "
            f"checkpoint needs about {size_text(needed)}"
        )
    return ""
