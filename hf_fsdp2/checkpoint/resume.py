"""The checkpoints of a run folder: run identity, listing, checks of the files, the one a resume continues from,
and the config changes a resume accepts.
"""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
import yaml

from hf_fsdp2.checkpoint.layout import (
    CONFIG_FILE,
    LATEST,
    PREFIX,
    STATE_FILE,
    CheckpointError,
    checkpoint_dir,
)
from hf_fsdp2.checkpoint.manifest import manifest_problems

logger = logging.getLogger("hf_fsdp2")

# Keys whose change makes a resumed run a different run: refused. Every other key may change
# (logging, save cadence, export settings...): the change is logged.
MUST_MATCH = (
    "model_name_or_path",
    "ref_model_name_or_path",
    "tokenizer_name_or_path",
    "dataset_name",
    "dataset_config_name",
    "dataset_split",
    "dataset_format",
    "max_length",
    "assistant_only_loss",
    "completion_only_loss",
    "packing",
    "seed",
    "per_device_train_batch_size",
    "use_peft",
    "dataset_mixture",
    "dataset_column_mapping",
    "dataset_tools",
    "dataset_revision",
    "chat_loss",
    "long_examples",
    "on_bad_record",
    "eval_split_fraction",
    "padding_free",
    "train_sampling_strategy",
    "load_in_4bit",
    "freeze_vision_tower",
    "freeze_multi_modal_projector",
)

# What a key of MUST_MATCH means when a checkpoint's config predates it (absent: the old behaviour, the default).
# The freeze keys: true. Before them, a composite's tower and projector were trainable but never ran on text rows, so
# they took no gradient and AdamW never moved them (nor kept state for them): those checkpoints hold a tower equal
# to the source's, as a frozen one is; a text model has neither part.
ABSENT_MEANS: dict[str, Any] = {
    "load_in_4bit": False,
    "freeze_vision_tower": True,
    "freeze_multi_modal_projector": True,
}

# Why a change of these keys is refused, and the fix, for the message (value in the checkpoint -> text).
_WHY: dict[str, dict[Any, str]] = {
    "load_in_4bit": {
        True: "the adapter was trained over the base quantised to NF4 (QLoRA); resuming on the full-precision base "
        "would continue it on other weights than those it was fitted to: resume with --load_in_4bit true",
        False: "the checkpoint was trained over the full-precision base; resuming over the NF4-quantised base would "
        "continue it on other weights than those it was fitted to: resume with --load_in_4bit false",
    },
}


def new_run_id() -> str:
    """A fresh run identity (written into every checkpoint of the run)."""
    return uuid.uuid4().hex[:12]


def run_id_of(path: Path) -> str:
    """The run id in a checkpoint's trainer state; "" when it has none or the file cannot be read."""
    try:
        return str(json.loads((path / STATE_FILE).read_text()).get("run_id", ""))
    except (OSError, ValueError, AttributeError):
        return ""


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints (those with a trainer_state.json), oldest first."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = []
    for p in out.iterdir():
        if (
            p.is_dir()
            and p.name.startswith(PREFIX)
            and p.name[len(PREFIX) :].isdigit()
            and (p / STATE_FILE).is_file()
        ):
            found.append(p)
    return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]))


def checkpoint_problems(path: Path, *, digests: bool = True) -> list[str]:
    """What is wrong with a checkpoint folder's files (empty: every file DCP's index names is there,
    at least as long as the index says, and, with ``digests``, every file's bytes match its ``manifest.json``
    digest: :mod:`hf_fsdp2.checkpoint.manifest`, which reads every file once). Without ``digests``: sizes only.
    """
    problems = []
    for name in (STATE_FILE, ".metadata", CONFIG_FILE):
        if not (path / name).is_file():
            problems.append(f"{name} is missing")
    if problems:
        return problems
    problems = _text_file_problems(path)
    if problems:
        return problems
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # a truncated or garbled index
        return [f".metadata cannot be read ({type(err).__name__}: {err})"]
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is not None:
            needed[rel] = max(needed.get(rel, 0), int(info.offset) + int(info.length))
    for rel, size in sorted(needed.items()):
        file = path / rel
        if not file.is_file():
            problems.append(f"{rel} is missing")
        elif file.stat().st_size < size:
            problems.append(f"{rel} is {file.stat().st_size} bytes, its index needs {size} (truncated)")
    if digests and not problems:
        problems = manifest_problems(path)
    return problems


def _text_file_problems(path: Path) -> list[str]:
    """The trainer state (JSON) and the config (YAML) each parse to a mapping, or what is wrong with them."""
    problems = []
    for name, kind in ((STATE_FILE, "JSON"), (CONFIG_FILE, "YAML")):
        try:
            text = (path / name).read_text()
            value = json.loads(text) if kind == "JSON" else yaml.safe_load(text)
        except UnicodeDecodeError as err:
            problems.append(f"{name} is not text (byte {err.start}: {err.reason})")
            continue
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f"line {mark.line + 1}: " if mark is not None else ""
            problems.append(f"{name} is not valid YAML ({where}{getattr(err, 'problem', None) or err})")
            continue
        except ValueError as err:
            problems.append(f"{name} is not valid JSON ({err})")
            continue
        if not isinstance(value, dict):
            problems.append(f"{name} does not hold a mapping of settings ({type(value).__name__})")
    return problems


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The checkpoint folder the ``latest`` file names (which may be missing), or None without that file."""
    pointer = Path(output_dir) / LATEST
    if not pointer.is_file():
        return None
    text = pointer.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(
            f"{pointer} should hold a step number, not {text[:40]!r}; delete it and resume from a "
            "checkpoint-<step> path"
        )
    return checkpoint_dir(output_dir, int(text))


def _other_run(path: Path, owner: str) -> str:
    """The run id of ``path`` when it is known and differs from ``owner`` (known), else ""."""
    other = run_id_of(path)
    return other if owner and other and other != owner else ""


def resolve_resume(output_dir: str | Path, value: str) -> Path:
    """The checkpoint folder that ``resume_from_checkpoint`` names.

    Args:
        output_dir: the run folder (``latest`` is looked up there).
        value: ``"latest"`` or a path to a ``checkpoint-<step>`` folder.

    Returns:
        A complete checkpoint folder of the run that ``latest`` names (when it names one).

    Raises:
        CheckpointError: no checkpoint, an incomplete one, ``latest`` naming a missing checkpoint, or a
            checkpoint of another run than the one ``latest`` names (both run ids named).
    """
    named = latest_checkpoint(output_dir)
    owner = run_id_of(named) if named is not None else ""
    if value == "latest":
        complete = list_checkpoints(output_dir)
        if named is not None and not named.is_dir() and complete:
            raise CheckpointError(
                f"resume_from_checkpoint=latest: {Path(output_dir) / LATEST} names {named.name}, which does not "
                f"exist (found: {', '.join(p.name for p in complete)}); give the checkpoint to continue as a path, "
                "or start a new run"
            )
        if named is not None and named.is_dir():
            complete = [p for p in complete if p != named] + [named]
        if not complete:
            raise CheckpointError(
                f"resume_from_checkpoint=latest but {output_dir} holds no complete checkpoint; "
                "train without resume_from_checkpoint, or give a checkpoint path"
            )
        # The newest checkpoint of latest's run whose files are all there; a damaged one is named and skipped.
        for path in reversed(complete):
            other = _other_run(path, owner)
            if other:
                logger.warning(
                    "resume_from_checkpoint=latest: skipping %s, written by run %s, not by run %s that 'latest' "
                    "(%s) names",
                    path,
                    other,
                    owner,
                    named.name if named is not None else "?",
                )
                continue
            problems = checkpoint_problems(path)
            if not problems:
                return path
            logger.warning(
                "resume_from_checkpoint=latest: skipping %s, which is damaged (%s); trying an earlier one",
                path,
                "; ".join(problems[:3]),
            )
        raise CheckpointError(
            f"resume_from_checkpoint=latest: no checkpoint in {output_dir} is both whole and of the run 'latest' "
            f"names ({', '.join(p.name for p in complete)}); start a new run or restore the files"
        )
    path = Path(value).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"resume_from_checkpoint={value!r}: no such folder {path}")
    if not (path / STATE_FILE).is_file() or not (path / ".metadata").is_file():
        raise CheckpointError(
            f"resume_from_checkpoint: {path} is incomplete (no {STATE_FILE} or .metadata: the save was "
            "interrupted); resume from an earlier checkpoint-<step> or from 'latest'"
        )
    other = _other_run(path, owner)
    if other and named is not None:
        raise CheckpointError(
            f"resume_from_checkpoint: {path} was written by run {other}, but 'latest' in {output_dir} names "
            f"{named.name} of run {owner}: continuing it there would mix two runs' checkpoints. Resume with "
            f"--resume_from_checkpoint latest, or resume {path} into another output_dir"
        )
    problems = checkpoint_problems(path)
    if problems:
        raise CheckpointError(
            f"resume_from_checkpoint: {path} is damaged: {'; '.join(problems[:3])}. Resume from an earlier "
            "checkpoint-<step>, or from 'latest' (which skips damaged checkpoints)"
        )
    return path


def check_config_compatible(
    saved: dict[str, Any], current: dict[str, Any], data_worlds: tuple[int, int] = (1, 1)
) -> list[str]:
    """Compare a checkpoint's config with the current one.

    ``data_worlds``: the data-parallel ranks then and now (world / (cp x tp)). A per-device batch size that changes
    with them so that the examples of a micro-step over all ranks stay the same (flat FSDP2 over 4 ranks with 2 each
    -> cp 2 x dp 2 with 4 each) reads the same batches: allowed.

    Returns:
        Human-readable notes of harmless changes (to log).

    Raises:
        CheckpointError: a change that makes the resumed run a different run, naming each key and both values.
    """
    bad = []
    for k in MUST_MATCH:
        then = saved.get(k, ABSENT_MEANS.get(k))
        if (
            k == "per_device_train_batch_size"
            and (then or 0) * data_worlds[0] == current.get(k, 0) * data_worlds[1]
        ):
            continue  # the same examples per micro-step over all data-parallel ranks
        now = current.get(k, ABSENT_MEANS.get(k))
        if then != now:
            why = _WHY.get(k, {}).get(then)
            bad.append(f"{k}: checkpoint {then!r} vs now {now!r}" + (f" ({why})" if why else ""))
    if bad:
        raise CheckpointError(
            "cannot resume: the config changed in ways that change the model or the data: "
            + "; ".join(bad)
            + ". Restore those values, or start a new run in a new output_dir"
        )
    ignore = {"resume_from_checkpoint", "overwrite_output_dir"}
    return [
        f"{k}: {saved.get(k)!r} -> {current.get(k)!r}"
        for k in sorted(set(saved) | set(current))
        if k not in ignore and saved.get(k) != current.get(k)
    ]


def resolve_auto(output_dir: str | Path) -> Path | None:
    """``resume_from_checkpoint=auto``: the newest whole checkpoint in ``output_dir`` (as ``latest`` finds it), or
    None when the folder holds no checkpoint (the run starts fresh). Whether it is this run's (its config keeps every
    key of :data:`MUST_MATCH`) is checked as it is resumed, against the run's resolved config.

    Raises:
        CheckpointError: no checkpoint in the folder is whole.
    """
    if not list_checkpoints(output_dir):
        return None
    return resolve_resume(output_dir, "latest")
