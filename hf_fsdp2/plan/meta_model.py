"""The run's model on the meta device, from its config alone: QLoRA's 4-bit base quantised by the run's own
:func:`hf_fsdp2.lora.quantize.quantize_base` (NF4 tensors on meta), LoRA applied by the run's own builder
(:mod:`hf_fsdp2.lora.build`), trainable parameters in the dtype FSDP2 keeps them in; the configs the planner
refuses (mixtures of experts whose experts are not fused) and the decoder-layer classes the run shards by."""

from __future__ import annotations

import copy
from typing import Any

import torch

from hf_fsdp2.config.plans import LoraSettings
from hf_fsdp2.dtypes import DTYPES
from hf_fsdp2.lora.build import wrap_with_lora
from hf_fsdp2.plan.settings import PlanError, PlanSettings

# Kernels transformers cannot load without their GPU packages: planned as SDPA running the GPU flash kernel,
# which saves the same tensors (query, key, value, output, logsumexp, RNG state).
_GPU_ONLY_ATTENTION = ("flash_attention_2", "flash_attention_3", "flex_attention")


def _wrap_lora(model: torch.nn.Module, lora: LoraSettings) -> torch.nn.Module:
    """PEFT LoRA on the meta model by the run's builder (:func:`hf_fsdp2.lora.build.wrap_with_lora`, which
    ``hf_fsdp2.lora.adapter.apply_lora`` calls too); PEFT's refusal as a :class:`PlanError`."""
    try:
        return wrap_with_lora(model, lora)
    except ValueError as err:
        raise PlanError(
            f"PEFT could not apply LoRA with lora_target_modules={lora.target_modules}: {err}"
        ) from err


def build_meta_model(model_config: Any, settings: PlanSettings) -> torch.nn.Module:
    """The run's model on the meta device: built from its config (a composite with its own class, its tower and
    projector frozen as the run freezes them), its base in NF4 with ``load_in_4bit``,
    LoRA-wrapped when planned, trainable
    parameters in the dtype FSDP2 keeps them in (fp32 masters under mixed precision, as Accelerate upcasts).

    Raises:
        PlanError: transformers cannot build the model from this config.
    """
    from hf_fsdp2.composite import auto_class, composite_spec, freeze_parts

    config = copy.deepcopy(model_config)
    auto = auto_class(config)  # a composite's own class, as the run loads it
    dtype = config.dtype if settings.load_dtype == "auto" else DTYPES[settings.load_dtype]
    name = settings.attn_implementation
    attn = None if name == "auto" else ("sdpa" if name in _GPU_ONLY_ATTENTION else name)
    try:
        with torch.device("meta"):
            model = auto.from_config(
                config, dtype=dtype, attn_implementation=attn, trust_remote_code=settings.trust_remote_code
            )
    except Exception as err:  # noqa: BLE001 - any model code's refusal (ValueError, AssertionError, ...) is the user's
        raise PlanError(
            f"cannot build {type(config).__name__} on the meta device with {auto.__name__}.from_config "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); is it a causal LM whose "
            "config loads in transformers?"
        ) from err
    model.config.use_cache = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().use_cache = False
    model.train()
    spec = composite_spec(config)
    if (
        spec is not None
    ):  # a composite's tower and projector frozen as the run freezes them, before the adapters
        freeze_parts(
            model,
            spec,
            freeze_vision_tower=settings.freeze_vision_tower,
            freeze_multi_modal_projector=settings.freeze_multi_modal_projector,
        )
    if settings.load_in_4bit and settings.lora is not None:  # QLoRA: the run's own quantisation, on meta
        from hf_fsdp2.lora.quantize import QuantizationError, quantize_base

        try:
            quantize_base(
                model,
                layer_classes(model, settings),
                shards=settings.shard_size,
                skip=tuple(settings.lora.modules_to_save or ()),
                meta_ok=True,
            )
        except QuantizationError as err:
            raise PlanError(str(err)) from err
    if settings.lora is not None:
        model = _wrap_lora(model, settings.lora)
    if settings.compute_dtype is not None:
        for param in model.parameters():
            if param.requires_grad and param.dtype != torch.float32:
                param.data = param.data.float()
    return model


# Config keys of a mixture of experts (experts per layer), across the families transformers ships.
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def experts_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The fused experts modules under ``module`` (a ``@use_experts_implementation`` class: fused 3-D tensors with the
    experts on dim 0; PEFT's wrappers looked through)."""
    return [
        m
        for m in module.modules()
        if all(hasattr(m, key) for key in ("has_gate", "is_transposed", "num_experts"))
        and any(p.dim() == 3 for p in m.parameters(recurse=False))
    ]


def check_plannable(model_config: Any, model: torch.nn.Module) -> None:
    """Refuse a model whose activation memory the meta forward cannot predict.

    A mixture of experts computes each expert on the tokens the router sends it. transformers' fused experts
    (``grouped_mm``, its default) run every (token, choice) row through one grouped matmul: ``tokens x top_k`` rows
    whatever the routing, so the meta forward counts them exactly. Experts of another kind (a loop over expert
    modules, Llama 4's) split the tokens by the router's values, which a meta tensor does not have.

    Raises:
        PlanError: a MoE config (a composite's text config too) without fused experts, with the key that says so
            and what to do instead.
    """
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    for key in _EXPERT_KEYS:
        experts = getattr(text, key, None)
        if isinstance(experts, int) and experts > 1 and not experts_modules(model):
            raise PlanError(
                f"{type(model_config).__name__} is a mixture of experts ({key}={experts}) whose experts are not "
                "transformers' fused experts (the @use_experts_implementation classes, whose grouped matmul runs "
                "tokens x top_k rows whatever the routing): which tokens each expert computes depends on the data, "
                "so its activation memory cannot be planned from the config; measure a short run instead (peak "
                "memory per step in metrics.jsonl and summary.json; memory_snapshot_steps on a GPU)"
            )


def layer_classes(model: torch.nn.Module, settings: PlanSettings) -> tuple[str, ...]:
    """The decoder-layer class names the run shards and checkpoints by (``fsdp_layer_cls_to_wrap``, else the
    model's ``_no_split_modules``); a name the model lacks as a :class:`PlanError`."""
    from hf_fsdp2.model import decoder_layer_classes

    try:
        return decoder_layer_classes(model, list(settings.layer_cls) or None)
    except ValueError as err:
        raise PlanError(str(err)) from err
