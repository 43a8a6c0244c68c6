"""The one LoRA builder: the ``peft.LoraConfig`` of a recipe's LoRA settings and the wrap that makes the
adapter trainable in fp32. The run (:func:`hf_fsdp2.lora.adapter.apply_lora`) and the memory plan
(:func:`hf_fsdp2.plan.meta_model.build_meta_model`, on the meta device) both call it, so the
plan counts the adapter the run trains. It stands on the settings alone (no other hf_fsdp2 module), below both.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_fsdp2.config.plans import LoraSettings


def lora_config(settings: LoraSettings) -> Any:
    """The ``peft.LoraConfig`` for a causal LM (or a reward model: ``settings.task_type``).

    Args:
        settings: rank, alpha, dropout, target modules (names or ``all-linear``), modules to save, rsLoRA, DoRA.

    Returns:
        A ``peft.LoraConfig`` with the settings' ``task_type`` (``CAUSAL_LM`` or ``SEQ_CLS``).
    """
    from peft import LoraConfig

    targets: list[str] | str = settings.target_modules
    if isinstance(targets, list) and targets == ["all-linear"]:
        targets = "all-linear"
    return LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=targets,
        modules_to_save=list(settings.modules_to_save) if settings.modules_to_save else None,
        use_rslora=settings.use_rslora,
        use_dora=settings.use_dora,
        bias="none",
        task_type=settings.task_type,
    )


def wrap_with_lora(model: torch.nn.Module, settings: LoraSettings) -> torch.nn.Module:
    """``model`` wrapped by PEFT LoRA: the base frozen in its dtype, what trains (the adapter and
    ``modules_to_save``) fp32 master copies, as Accelerate keeps trainable parameters under mixed precision.

    Raises:
        ValueError: PEFT's, when a target module matches nothing (each caller names the fix in its own error).
    """
    from peft import get_peft_model

    wrapped = get_peft_model(model, lora_config(settings), autocast_adapter_dtype=True)
    for param in wrapped.parameters():
        if param.requires_grad and param.is_floating_point() and param.dtype != torch.float32:
            param.data = param.data.float()  # fp32 master copies of what trains (modules_to_save too)
    return wrapped
