"""Offline export of a LoRA run's checkpoint: the adapter and, if the run merged, the merged model, as the
run would have written them at the end (``hf-fsdp2 export`` passes :func:`wrap_lora` and :func:`write_lora` to
:func:`hf_fsdp2.export.offline.export_checkpoint` for LoRA runs)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hf_fsdp2.config import PeftArgs
from hf_fsdp2.config.plans import LoraSettings
from hf_fsdp2.dtypes import DTYPES
from hf_fsdp2.export.errors import ExportResult
from hf_fsdp2.export.offline import OfflineExport
from hf_fsdp2.lora.adapter import ADAPTER_WEIGHTS_NAME, apply_lora
from hf_fsdp2.lora.save import export_lora


def lora_settings(cfg: dict[str, Any]) -> LoraSettings:
    """The LoRA settings of a run, from its resolved config (as the run built them)."""
    keys = {f.name for f in dataclasses.fields(PeftArgs)}
    return PeftArgs(**{k: v for k, v in cfg.items() if k in keys}).lora_settings()


def run_load_dtype(cfg: dict[str, Any]) -> torch.dtype:
    """The dtype the run loaded its base in: ``torch_dtype``, or for ``auto`` the dtype of the model's config
    (float32 when it names none, as transformers loads it)."""
    name = cfg.get("torch_dtype") or "auto"
    if name != "auto":
        return DTYPES[name]
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(
        cfg["model_name_or_path"],
        revision=cfg.get("model_revision"),
        trust_remote_code=bool(cfg.get("trust_remote_code")),
    )
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = DTYPES.get(dtype.removeprefix("torch."))
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def wrap_lora(model: Any, cfg: dict[str, Any], world: int) -> Any:
    """The base model, loaded in the run's ``torch_dtype`` as the run loaded it, with the run's LoRA adapter applied
    (the ``wrap`` of an offline export); a QLoRA run's base quantised first as the run quantised it: from that
    dtype (the scales are computed in it, so the codes depend on it) and for the run's ``world`` ranks (the scale
    blocks depend on it). The export computes in fp32: the other frozen weights are upcast after (their values
    stay the run's)."""
    from hf_fsdp2.lora.quantize import is_nf4, quantize_base

    if cfg.get("load_in_4bit"):
        from hf_fsdp2.model import decoder_layer_classes

        layers = decoder_layer_classes(model, cfg.get("fsdp_layer_cls_to_wrap") or None)
        quantize_base(model, layers, shards=world, skip=tuple(cfg.get("lora_modules_to_save") or ()))
    from hf_fsdp2.model import auto_class_name

    settings = lora_settings(cfg)
    if (
        auto_class_name(model.config) == "AutoModelForSequenceClassification"
    ):  # a reward model, as the run wrapped it
        settings = dataclasses.replace(settings, task_type="SEQ_CLS")
    wrapped = apply_lora(model, settings)
    for param in wrapped.parameters():  # parameters only: buffers computed at init (rotary) keep their dtype
        if param.is_floating_point() and not is_nf4(param) and param.dtype != torch.float32:
            param.data = param.data.float()
    return wrapped


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
        base_dtype=run_load_dtype(job.cfg),
        verify=verify,
        verify_atol=verify_atol,
        model_card=job.card,
        is_main_process=True,
        source=job.source,
    )
    files = [ADAPTER_WEIGHTS_NAME] + (["merged/"] if done.merged_dir else [])
    return ExportResult(
        out_dir=job.out,
        files=files,
        total_bytes=0,
        dtype="float32",
        seconds=0.0,
        verify=done.merged_report or done.adapter_report,
    )
