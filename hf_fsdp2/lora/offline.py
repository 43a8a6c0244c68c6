"""Offline export of a LoRA run's checkpoint: the adapter and, if the run merged, the merged model, as the
run would have written them at the end (``hf-fsdp2 export`` passes :func:`wrap_lora` and :func:`write_lora` to
:func:`hf_fsdp2.export.offline.export_checkpoint` for LoRA runs)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hf_fsdp2.config import PeftArgs
from hf_fsdp2.config.plans import LoraSettings
from hf_fsdp2.export.errors import ExportResult
from hf_fsdp2.export.offline import OfflineExport
from hf_fsdp2.lora.adapter import ADAPTER_WEIGHTS_NAME, apply_lora
from hf_fsdp2.lora.save import export_lora


def lora_settings(cfg: dict[str, Any]) -> LoraSettings:
    """The LoRA settings of a run, from its resolved config (as the run built them)."""
    keys = {f.name for f in dataclasses.fields(PeftArgs)}
    return PeftArgs(**{k: v for k, v in cfg.items() if k in keys}).lora_settings()


def wrap_lora(model: Any, cfg: dict[str, Any], world: int) -> Any:
    """The base model with the run's LoRA adapter applied (the ``wrap`` of an offline export); a QLoRA run's
    base quantised first, as the run quantised it for its ``world`` ranks (the scale blocks depend on it)."""
    if cfg.get("load_in_4bit"):
        from hf_fsdp2.lora.quantize import quantize_base
        from hf_fsdp2.model import decoder_layer_classes

        layers = decoder_layer_classes(model, cfg.get("fsdp_layer_cls_to_wrap") or None)
        quantize_base(model, layers, shards=world, skip=tuple(cfg.get("lora_modules_to_save") or ()))
    return apply_lora(model, lora_settings(cfg))


def write_lora(job: OfflineExport, verify: bool, verify_atol: float | None) -> ExportResult:
    """The adapter of a LoRA run's checkpoint in ``job.out``, and the merged model in ``job.out/merged`` when
    the run had ``merge_adapter``; both verified as at the end of training (one process, fp32). The ``write``
    of :func:`hf_fsdp2.export.offline.export_checkpoint` for LoRA runs.

    Raises:
        ExportError: a failed write.
        ExportVerificationError: a written folder does not reproduce the checkpoint's model.
    """
    done = export_lora(
        job.model,
        job.out,
        base_model=job.cfg["model_name_or_path"],
        tokenizer=job.tokenizer,
        merge=bool(job.cfg.get("merge_adapter")),
        layer_cls_names=(),
        mp_policy=None,
        dtype=job.dtype,
        max_shard_bytes=job.max_shard_bytes,
        compute_dtype=torch.float32,
        verify=verify,
        verify_atol=verify_atol,
        model_card=job.card,
        is_main_process=True,
    )
    files = [ADAPTER_WEIGHTS_NAME] + (["merged/"] if done.merged_dir else [])
    return ExportResult(
        out_dir=job.out, files=files, total_bytes=0, dtype="float32", seconds=0.0,
        verify=done.merged_report or done.adapter_report,
    )  # fmt: skip
