"""What ``hf-fsdp2 eval-harness`` evaluates: an export folder, a LoRA adapter over its base, or a training checkpoint
exported on the fly (gather-free, one process, verified: the code of ``hf-fsdp2 export``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

ADAPTER_CONFIG = "adapter_config.json"


class HarnessError(ValueError):
    """A model folder, task list or backend the harness cannot use; the message names the value and the fix."""


@dataclass(frozen=True, kw_only=True)
class EvalModel:
    """A model as lm-eval loads it.

    Attributes:
        source: what the user named (folder or hub id).
        kind: ``export`` (an HF folder or hub id), ``adapter`` (a PEFT adapter folder), ``checkpoint``.
        pretrained: the folder or hub id lm-eval loads (``pretrained=``): the base model of an adapter.
        adapter: the adapter folder (``peft=``), or None.
        folder: the folder whose README.md model card gets the results (None: a hub id).
    """

    source: str
    kind: Literal["export", "adapter", "checkpoint"]
    pretrained: str
    adapter: str | None
    folder: Path | None


def is_checkpoint(path: Path) -> bool:
    """A ``checkpoint-<step>`` folder of a run (DCP shards and the trainer state)."""
    return (path / ".metadata").is_file() and (path / "trainer_state.json").is_file()


def adapter_rank(folder: Path) -> int:
    """The largest LoRA rank of an adapter folder: ``r`` and every ``rank_pattern`` override (PEFT's per-module
    ranks), from its adapter_config.json.

    Raises:
        HarnessError: an unreadable adapter config, or one without an integer ``r``.
    """
    try:
        saved = json.loads((folder / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as err:
        raise HarnessError(
            f"{folder / ADAPTER_CONFIG} cannot be read ({err}); re-export the adapter (hf-fsdp2 export)"
        ) from err
    saved = saved if isinstance(saved, dict) else {}
    found: list[Any] = [saved.get("r"), *(saved.get("rank_pattern") or {}).values()]
    ranks = [r for r in found if isinstance(r, int) and not isinstance(r, bool) and r > 0]
    if len(ranks) != len(found):
        raise HarnessError(
            f"{folder / ADAPTER_CONFIG}: LoRA rank r={found[0]!r} and rank_pattern values {found[1:]} must be "
            "positive integers; re-export the adapter (hf-fsdp2 export)"
        )
    return max(ranks)


def adapter_model(folder: Path, *, source: str, base: str | None = None) -> EvalModel:
    """A PEFT adapter folder over its base: ``base``, else the adapter's ``base_model_name_or_path``.

    Raises:
        HarnessError: an unreadable adapter config, or one naming no base.
    """
    try:
        saved = json.loads((folder / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as err:
        raise HarnessError(
            f"{folder / ADAPTER_CONFIG} cannot be read ({err}); re-export the adapter (hf-fsdp2 export)"
        ) from err
    base = base or (saved.get("base_model_name_or_path") if isinstance(saved, dict) else None)
    if not base:
        raise HarnessError(
            f"{folder / ADAPTER_CONFIG} names no base_model_name_or_path; pass the base with --adapter-base MODEL"
        )
    return EvalModel(source=source, kind="adapter", pretrained=str(base), adapter=str(folder), folder=folder)


def resolve_model(
    name: str | Path, *, export_dir: Path | None = None, adapter_base: str | None = None
) -> EvalModel:
    """What ``name`` is and how lm-eval loads it; a checkpoint is exported first, into ``export_dir``.

    Args:
        name: an export folder, an adapter folder, a ``checkpoint-<step>`` folder, or a hub id.
        export_dir: where a checkpoint is exported (empty or new); needed for a checkpoint.
        adapter_base: the base of an adapter, instead of the one its config names.

    Returns:
        The model to evaluate.

    Raises:
        HarnessError: a folder that is none of these, or a checkpoint without ``export_dir``.
        ExportError: the checkpoint's export failed (incomplete checkpoint, failed verification, ...).
    """
    path = Path(name).expanduser()
    if not path.exists():
        if str(name).count("/") == 1 and not str(name).startswith((".", "/", "~")):
            return EvalModel(source=str(name), kind="export", pretrained=str(name), adapter=None, folder=None)
        raise HarnessError(
            f"{name}: no such folder; give an export folder, a LoRA adapter folder, a checkpoint-<step> folder or "
            "a hub id (namespace/name)"
        )
    if (path / ADAPTER_CONFIG).is_file():
        return adapter_model(path, source=str(name), base=adapter_base)
    if (path / "config.json").is_file():
        return EvalModel(source=str(name), kind="export", pretrained=str(path), adapter=None, folder=path)
    if is_checkpoint(path):
        if export_dir is None:
            raise HarnessError(f"{path} is a checkpoint: it needs a folder to be exported into (export_dir)")
        model = adapter_or_export(export_checkpoint_for_eval(path, export_dir), adapter_base)
        return EvalModel(
            source=str(name),
            kind="checkpoint",
            pretrained=model.pretrained,
            adapter=model.adapter,
            folder=model.folder,
        )
    raise HarnessError(
        f"{path} is not a model folder (no config.json), a LoRA adapter ({ADAPTER_CONFIG}) or a checkpoint "
        "(.metadata + trainer_state.json); give the folder a run exported, or one of its checkpoint-<step> folders"
    )


def adapter_or_export(folder: Path, adapter_base: str | None) -> EvalModel:
    """An exported folder (a full model, or a LoRA run's adapter) as lm-eval loads it."""
    if (folder / ADAPTER_CONFIG).is_file():
        return adapter_model(folder, source=str(folder), base=adapter_base)
    return EvalModel(source=str(folder), kind="export", pretrained=str(folder), adapter=None, folder=folder)


def export_checkpoint_for_eval(checkpoint: Path, out_dir: Path) -> Path:
    """``hf-fsdp2 export CHECKPOINT OUT_DIR``: the checkpoint's consolidated folder (a LoRA run's: its adapter),
    written gather-free in one process and verified, in the run's ``export_dtype``, with its model card.

    Raises:
        ExportError: as ``hf-fsdp2 export``.
    """
    import yaml

    from hf_fsdp2.checkpoint.layout import STATE_FILE
    from hf_fsdp2.config import CONFIG_NAME
    from hf_fsdp2.export import export_checkpoint
    from hf_fsdp2.export.offline import write_full_model
    from hf_fsdp2.lora.offline import wrap_lora, write_lora
    from hf_fsdp2.observe.logs import last_metrics

    saved: Any = (
        yaml.safe_load((checkpoint / CONFIG_NAME).read_text()) if (checkpoint / CONFIG_NAME).is_file() else {}
    )
    lora = bool((saved if isinstance(saved, dict) else {}).get("use_peft"))
    try:
        metrics = last_metrics(
            checkpoint.parent, int(json.loads((checkpoint / STATE_FILE).read_text())["step"])
        )
    except (OSError, ValueError, KeyError):
        metrics = None
    export_checkpoint(
        checkpoint,
        out_dir,
        metrics=metrics,
        wrap=wrap_lora if lora else None,
        write=write_lora if lora else write_full_model,
    )
    return out_dir
