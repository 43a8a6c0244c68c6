"""The run folder (``output_dir``): one run owns it at a time, and a previous run is never overwritten by
accident.

A run takes an exclusive lock (``.hf_fsdp2.lock``, created with O_EXCL, holding host, pid and start
time) before it writes anything, and removes it when it ends. A lock whose process is gone (same host,
pid not alive) is stale and taken over; a live one refuses the second run with its owner named.
A folder that holds only what a run writes before its first step (its resolved config, the lock, tracker
and debug folders) is reused: a failed start never blocks the same command run again.
A folder overwritten (``overwrite_output_dir``) first loses everything the previous run wrote: its checkpoints and
``latest`` (so that retention and ``resume_from_checkpoint latest`` can never pick up a checkpoint of that other
run), and its records and export (summary, metrics, model card, weights, config, tokenizer, adapter, plots), so
that a new run that fails before it writes its own never leaves a folder whose summary and model describe another
run than its config. Files no run writes are kept.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Collection
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import yaml

from hf_fsdp2.checkpoint.layout import ATTEMPT_DIR, LATEST, PREFIX, RESTARTS_FILE, TMP_PREFIX, CheckpointError
from hf_fsdp2.checkpoint.resume import check_config_compatible, resolve_auto
from hf_fsdp2.config import CONFIG_NAME, ConfigError

logger = logging.getLogger("hf_fsdp2")

LOCK_NAME = ".hf_fsdp2.lock"
# What a run writes before its first training step; a folder holding nothing else has no run to keep.
START_FILES = {
    CONFIG_NAME,
    LOCK_NAME,
    ATTEMPT_DIR,
    RESTARTS_FILE,
    "debug",
    "tensorboard",
    "profile",
    ".export-incomplete",
    ".adapter-incomplete",
}


def previous_run(output_dir: Path) -> list[str]:
    """Names of the entries that show a run got past its start (sorted); empty when there is none."""
    if not output_dir.is_dir():
        return []
    found = []
    for entry in output_dir.iterdir():
        if entry.name in START_FILES:
            continue
        found.append(entry.name)
    return sorted(found)


def check_output_dir(output_dir: str | Path, *, overwrite: bool, resume: bool = False) -> None:
    """Refuse to train into a folder that holds a previous run, unless asked to overwrite or resume.

    Args:
        output_dir: the run folder (created later if missing).
        overwrite: ``overwrite_output_dir``; the previous run's files are then replaced as the new run
            writes its own.
        resume: ``resume_from_checkpoint`` is set: the previous run is the one being continued.

    Raises:
        ConfigError: the folder holds a previous run and neither is set, the path is a file, or the folder (or
            the nearest existing folder above it) cannot be written (a read-only disk, permissions).
    """
    p = Path(output_dir)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"output_dir={str(p)!r} is a file, not a folder; choose another output_dir")
    check_writable(p)
    found = previous_run(p)
    if not found or overwrite or resume:
        return
    has_checkpoint = any(name.startswith("checkpoint-") for name in found)
    fixes = "choose a new output_dir, or pass --overwrite_output_dir true"
    if has_checkpoint:
        fixes += ", or continue it with --resume_from_checkpoint latest"
    raise ConfigError(
        f"output_dir={str(p)!r} already holds a previous run ({', '.join(found[:5])}"
        f"{', ...' if len(found) > 5 else ''}); {fixes}"
    )


# What a run leaves in its folder besides checkpoints and START_FILES: its records (metrics, summary, eval samples,
# plots) and its export (the full model's or the adapter's files, the merged model, the tokenizer, the model card).
RUN_OUTPUTS = (
    "metrics.jsonl",
    "summary.json",
    "samples.jsonl",
    "plots",
    "README.md",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model-*-of-*.safetensors",
    "model.safetensors.index.json",
    "modeling_score_head.py",
    "adapter_model.safetensors",
    "adapter_config.json",
    "merged",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    ".hf_fsdp2_export.json",  # the export's record of its verification (hf_fsdp2.export.folder.RECORD_NAME)
    RESTARTS_FILE,
)


def _written_by_a_run(entry: Path) -> bool:
    name = entry.name
    if entry.is_dir():  # a link to a folder too: the link is removed, not its target
        is_checkpoint = name.startswith(PREFIX) and name[len(PREFIX) :].isdigit()
        return is_checkpoint or name.startswith(TMP_PREFIX) or name in ("plots", "merged", ATTEMPT_DIR)
    return name == LATEST or any(fnmatch(name, pattern) for pattern in RUN_OUTPUTS)


def clear_previous_run(
    output_dir: str | Path, keep: Collection[str] = (), reason: str = "overwrite_output_dir"
) -> list[str]:
    """Delete what a previous run wrote (checkpoints, interrupted saves, ``latest``, :data:`RUN_OUTPUTS`) from a
    folder being overwritten (rank 0, holding the run lock, before the new run writes anything); returns the names
    removed, sorted. Other files are kept, and those named in ``keep``.

    Raises:
        ConfigError: one cannot be removed (permissions, a read-only disk), naming it.
    """
    p = Path(output_dir)
    if not p.is_dir():
        return []
    removed = []
    for entry in sorted(p.iterdir()):
        name = entry.name
        if name in keep or not _written_by_a_run(entry):
            continue
        try:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        except OSError as err:
            raise ConfigError(
                f"overwrite_output_dir: cannot remove the previous run's {entry} ({err.strerror}); remove it "
                "yourself or choose another output_dir"
            ) from None
        removed.append(name)
    if removed:
        logger.warning(
            "%s: removed the previous run's checkpoints and outputs from %s: %s",
            reason,
            p,
            ", ".join(removed),
        )
    return removed


def check_writable(output_dir: Path) -> None:
    """Refuse a run folder that cannot be written, before any work (a read-only disk refuses even root).

    Raises:
        ConfigError: naming the folder that cannot be written and why.
    """
    existing = output_dir.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not os.access(existing, os.W_OK | os.X_OK):
        try:  # the reason: a read-only file system, or permissions
            read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
        except OSError:
            read_only = False
        why = "it is on a read-only file system" if read_only else "permission denied"
        raise ConfigError(
            f"output_dir={str(output_dir)!r} cannot be written: {existing} is not writable ({why}); choose a "
            "writable output_dir"
        )


def _unwritable(err: OSError, path: Path) -> ConfigError:
    return ConfigError(
        f"output_dir={str(path.parent)!r} cannot be written ({err.strerror}: {err.filename or path}); choose a "
        "writable output_dir"
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """The exclusive ownership of a run folder by one run (taken and released by its rank 0)."""

    def __init__(self, output_dir: str | Path) -> None:
        self.path = Path(output_dir) / LOCK_NAME
        self.held = False

    def acquire(self) -> None:
        """Take the lock, replacing a stale one.

        Raises:
            ConfigError: another live run holds it (named with its host, pid and start time).
        """
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise _unwritable(err, self.path) from None
        owner = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except OSError as err:
                if not isinstance(err, FileExistsError):
                    raise _unwritable(err, self.path) from None
                holder = self._holder()
                if holder.get("host") == owner["host"] and not _alive(int(holder.get("pid", -1))):
                    logger.warning(
                        "output_dir lock %s was left by pid %s, which is gone; taking it over",
                        self.path,
                        holder.get("pid"),
                    )
                    self.path.unlink(missing_ok=True)
                    continue
                raise ConfigError(
                    f"output_dir={str(self.path.parent)!r} is in use by another run (pid {holder.get('pid', '?')} on "
                    f"{holder.get('host', '?')}, started {holder.get('started', '?')}); wait for it to end or choose "
                    f"another output_dir. If that run is dead (another host cannot be checked from here), delete "
                    f"{self.path}"
                ) from None
            with os.fdopen(fd, "w") as fh:
                fh.write(json.dumps(owner))
            self.held = True
            return
        raise ConfigError(
            f"could not take the output_dir lock {self.path}; delete it if no run is using the folder"
        )

    def _holder(self) -> dict[str, str | int]:
        try:
            data = json.loads(self.path.read_text() or "{}")
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def release(self) -> None:
        """Remove the lock if this process holds it (idempotent)."""
        if self.held:
            holder = self._holder()
            if holder.get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)
            self.held = False


def lock_holder(output_dir: str | Path) -> tuple[dict[str, str | int], bool]:
    """The run whose lock is in ``output_dir`` (empty: none) and whether a run would be refused for it (its pid is
    alive on this host, or it is on another host, which cannot be checked from here)."""
    lock = RunLock(output_dir)
    if not lock.path.is_file():
        return {}, False
    holder = lock._holder()
    if holder.get("host") != socket.gethostname():
        return holder, True
    return holder, _alive(int(holder.get("pid", -1)))


def claim_auto(output_dir: str | Path, current: dict[str, Any]) -> Path | None:
    """``resume_from_checkpoint=auto`` on a folder whose lock rank 0 holds: the checkpoint this run resumes from, or
    None to start fresh. A folder that holds no checkpoint but what an earlier attempt of this run left before its
    first one (its config the same in every key a resume keeps) is cleared of it, its restart history kept.

    Raises:
        CheckpointError: the folder holds another run's checkpoint, or no whole one.
        ConfigError: it holds another run's outputs without a checkpoint, or a finished run's.
    """
    p = Path(output_dir)
    path = resolve_auto(p)
    found = previous_run(p)
    if path is not None or not found:
        return path
    fixes = "choose a new output_dir, or pass --overwrite_output_dir true to replace it"
    if "summary.json" in found:
        raise ConfigError(
            f"resume_from_checkpoint=auto: output_dir={str(p)!r} holds a finished run (summary.json) and no "
            f"checkpoint to continue from; {fixes}"
        )
    try:
        saved = yaml.safe_load((p / CONFIG_NAME).read_text()) or {}
        check_config_compatible(saved, current)
    except (OSError, yaml.YAMLError, CheckpointError) as err:
        why = (
            str(err).split(": ", 1)[-1] if isinstance(err, CheckpointError) else f"no readable {CONFIG_NAME}"
        )
        raise ConfigError(
            f"resume_from_checkpoint=auto: output_dir={str(p)!r} holds another run's outputs "
            f"({', '.join(found[:5])}) and no checkpoint: {why}; {fixes}"
        ) from None
    clear_previous_run(
        p,
        keep={RESTARTS_FILE, ATTEMPT_DIR},
        reason="resume_from_checkpoint=auto: no checkpoint of this run to resume, starting fresh",
    )
    return None
