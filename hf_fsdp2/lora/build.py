"""The one LoRA builder: the ``peft.LoraConfig`` of a recipe's LoRA settings and the wrap that makes the
adapter trainable in fp32. The run (:func:`hf_fsdp2.lora.adapter.apply_lora`) and the memory plan
(:func:`hf_fsdp2.plan.meta_model.build_meta_model`, on the meta device) both call it, so the
plan counts the adapter the run trains. It stands on the settings alone (no other hf_fsdp2 module), below both.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from hf_fsdp2.config.plans import LoraSettings
from hf_fsdp2.lora.experts import resolve_target_parameters


def lora_config(settings: LoraSettings, target_parameters: list[str] | None = None) -> Any:
    """The ``peft.LoraConfig`` for a causal LM (or a reward model: ``settings.task_type``).

    Args:
        settings: rank, alpha, dropout, target modules (names or ``all-linear``), modules to save, rsLoRA, DoRA.
        target_parameters: PEFT's ``target_parameters`` with ``all-experts`` expanded for the model
            (:func:`hf_fsdp2.lora.experts.resolve_target_parameters`); None: none.

    Returns:
        A ``peft.LoraConfig`` with the settings' ``task_type`` (``CAUSAL_LM`` or ``SEQ_CLS``).
    """
    from peft import LoraConfig

    targets: list[str] | str | None = settings.target_modules
    if isinstance(targets, list) and targets == ["all-linear"]:
        targets = "all-linear"
    if not targets and target_parameters:  # the parameters alone (lora_target_modules: [])
        targets = None
    return LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=targets,
        target_parameters=target_parameters,
        modules_to_save=list(settings.modules_to_save) if settings.modules_to_save else None,
        use_rslora=settings.use_rslora,
        use_dora=settings.use_dora,
        bias="none",
        task_type=settings.task_type,
    )


def lora_exclusions(model: torch.nn.Module) -> dict[str, str]:
    """The linear modules of ``model`` that LoRA must leave alone, by name, with the reason (``all-linear`` skips
    them; a target list that names one is refused).

    - the ``out_proj`` of a Mamba-2 mixer (a module with the SSM's ``A_log`` and ``D``): in training on CUDA,
      transformers hands its weight straight to mamba-ssm's fused ``mamba_split_conv1d_scan_combined``, which never
      calls the module, so an adapter there would not train on a GPU (PEFT refuses it by model type, for Falcon-H1
      and Mamba, not for Granite 4 or Bamba);
    - an ``nn.Linear`` subclass of the model's own code with a forward of its own (Llama 4's router returns
      ``(scores, logits)``): LoRA adds its delta to a linear map's output, which that forward does not return.
    """
    found: dict[str, str] = {}
    for name, module in model.named_modules():
        out_proj = getattr(module, "out_proj", None)
        if hasattr(module, "A_log") and hasattr(module, "D") and isinstance(out_proj, torch.nn.Linear):
            found[f"{name}.out_proj"] = (
                f"the out_proj of {type(module).__name__}, a Mamba-2 mixer whose weight transformers passes to "
                "mamba-ssm's fused CUDA kernel without calling the module"
            )
        cls = type(module)
        if (
            isinstance(module, torch.nn.Linear)
            and cls.forward is not torch.nn.Linear.forward
            and cls.__module__.startswith("transformers.models.")
        ):
            found[name] = f"{cls.__name__}, an nn.Linear whose own forward returns more than the linear map"
    return found


def composite_parts(model: torch.nn.Module) -> tuple[str, ...]:
    """The module paths of a composite checkpoint's vision tower and projector in ``model`` (:mod:`hf_fsdp2.composite`;
    none for a causal LM): LoRA leaves every module under them out, whatever the target list, and QLoRA quantises
    none of them. Both are frozen for text rows (they never run on them); SigLIP's and Pixtral's attention has
    ``q_proj``/``v_proj`` too, so a target list of names alone would adapt the tower as well.

    Decided from the config (every rank alike; a reward model over a composite, Gemma 3's and Qwen3.5's
    ``*ForSequenceClassification``, holds the composite's model under the same paths).
    """
    from hf_fsdp2.composite import composite_spec

    spec = composite_spec(getattr(model, "config", None))
    return () if spec is None else (*spec.tower, *spec.projector)


def under(paths: tuple[str, ...], name: str) -> bool:
    """Whether module ``name`` is one of ``paths`` or inside one."""
    return any(name == p or name.startswith(p + ".") for p in paths)


def wrap_with_lora(model: torch.nn.Module, settings: LoraSettings) -> torch.nn.Module:
    """``model`` wrapped by PEFT LoRA: the base frozen in its dtype, what trains (the adapter and
    ``modules_to_save``) fp32 master copies, as Accelerate keeps trainable parameters under mixed precision.
    ``all-linear`` leaves out :func:`lora_exclusions` (written to the adapter's config as ``exclude_modules``); on a
    composite every target list leaves out the vision tower and the projector (:func:`composite_parts`; a regular
    expression over their paths in ``exclude_modules``, which PEFT reads back when it loads the adapter on the
    composite).

    ``settings.target_parameters`` (``lora_target_parameters``) go to PEFT's ``target_parameters``, ``all-experts``
    expanded to the model's fused expert weights (:mod:`hf_fsdp2.lora.experts`).

    Raises:
        ValueError: PEFT's, when a target module or parameter matches nothing, ``all-experts`` on a model without
            fused experts, or a target list naming a module of :func:`lora_exclusions` (each caller names the fix in
            its own error).
    """
    from peft import get_peft_model

    config = lora_config(settings, resolve_target_parameters(model, settings.target_parameters))
    parts = composite_parts(model)
    excluded = {n: why for n, why in lora_exclusions(model).items() if not under(parts, n)}
    if parts:
        # One pattern (PEFT full-matches it against each module name): the parts and what is under them, then
        # all-linear's other exclusions by name.
        patterns = [re.escape(p) + r"(?:\..*)?" for p in parts]
        if config.target_modules == "all-linear":
            patterns += [re.escape(n) for n in sorted(excluded)]
        config.exclude_modules = "|".join(patterns)
    elif excluded and config.target_modules == "all-linear":
        config.exclude_modules = sorted(excluded)
    if excluded and config.target_modules is not None and not isinstance(config.target_modules, str):
        named = {n: why for n, why in excluded.items() if n.rsplit(".", 1)[-1] in set(config.target_modules)}
        if named:
            first, why = next(iter(named.items()))
            raise ValueError(
                f"lora_target_modules names {first.rsplit('.', 1)[-1]} and {len(named)} such module(s) cannot take "
                f"LoRA ({first}: {why}); leave it out of the list (all-linear leaves it out by itself)"
            )
    wrapped = get_peft_model(model, config, autocast_adapter_dtype=True)
    for param in wrapped.parameters():
        if param.requires_grad and param.is_floating_point() and param.dtype != torch.float32:
            param.data = param.data.float()  # fp32 master copies of what trains (modules_to_save too)
    return wrapped
