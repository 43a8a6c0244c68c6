"""LoRA through PEFT: wrapping a model before sharding (the builder is :mod:`hf_fsdp2.lora.build`), and the
memory it takes.

The frozen base keeps its loaded dtype (bf16 with ``torch_dtype: bfloat16``); the trainable adapter
parameters are fp32 master copies (PEFT's ``autocast_adapter_dtype`` and accelerate's fp32 upcast of
trainable parameters under mixed precision). Both live in the same FSDP2 unit: under
``mixed_precision=bf16`` the policy casts every parameter to bf16 for the all-gather and the compute,
so the unit's all-gather is uniform, and only the adapter has gradients (reduced in fp32).
"""

from __future__ import annotations

import logging

import torch

from hf_fsdp2.config.plans import LoraSettings
from hf_fsdp2.lora.build import composite_parts, lora_exclusions, under, wrap_with_lora
from hf_fsdp2.lora.experts import (
    ALL_EXPERTS,
    expert_targets,
    is_param_wrapper,
    layer_suffix,
    resolve_target_parameters,
    route_expert_lora,
)

logger = logging.getLogger("hf_fsdp2")


ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
MERGED_DIR_NAME = "merged"


class LoraError(RuntimeError):
    """A LoRA setting or adapter that cannot be used; the message says why and what to do."""


def apply_lora(model: torch.nn.Module, settings: LoraSettings, *, seed: int | None = None) -> torch.nn.Module:
    """Wrap a loaded (unsharded) causal LM with PEFT LoRA; the base is frozen, the adapter fp32.

    Call it after loading and before sharding (``parallelize``), then build the optimizer on the
    result (``optim.param_groups`` keeps only trainable parameters).

    Args:
        model: the HF causal LM (on CPU, GPU or meta for rank-0-only loading).
        settings: the LoRA settings.
        seed: seeds the adapter's initialisation alone (a forked RNG), so that it depends on the seed and
            not on what ran before; every rank then starts from the same adapter. None = the global RNG.

    On a composite checkpoint the adapter targets the language model only (:func:`~hf_fsdp2.lora.build.
    composite_parts`): the vision tower and the projector are frozen and take none, whatever the target list.

    Returns:
        The ``PeftModelForCausalLM``.

    Raises:
        LoraError: a target module name that matches nothing in the model (on a composite: in its language model).
    """
    parts = composite_parts(model)
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    if parts:
        left = sorted(n for n in linears if under(parts, n))
        logger.info(
            "LoRA on %s: the adapter targets the language model only; the %d linear module(s) of its vision tower "
            "and projector (%s) take none: they are frozen and never run on text rows",
            type(model).__name__,
            len(left),
            ", ".join(parts),
        )
    all_linear = settings.target_modules in ("all-linear", ["all-linear"])
    excluded = {n: w for n, w in lora_exclusions(model).items() if not under(parts, n)} if all_linear else {}
    if excluded:
        logger.info(
            "LoRA all-linear leaves out %d module(s) that cannot take an adapter: %s",
            len(excluded),
            "; ".join(sorted(set(excluded.values()))),
        )
    expanded: list[str] = []
    if settings.target_parameters:
        try:
            expanded = resolve_target_parameters(model, settings.target_parameters) or []
        except ValueError as err:
            raise LoraError(str(err)) from err
        logger.info("LoRA lora_target_parameters=%s: %s", settings.target_parameters, expanded)
    try:
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            wrapped = wrap_with_lora(model, settings)
    except ValueError as err:
        raise _lora_error(model, settings, err, linears, parts) from err
    full = {
        f"{n.removeprefix('base_model.model.')}.{m.parameter_name}".replace(".base_layer", "")
        for n, m in wrapped.named_modules()
        if is_param_wrapper(m)
    }
    missed = [t for t in expanded if not any(f == t or f.endswith("." + t) for f in full)]
    if missed:  # PEFT refuses a list none of which matches, not one name of several
        three_d = sorted({_param_suffix(n) for n, p in model.named_parameters() if p.dim() == 3})
        raise LoraError(
            f"lora_target_parameters={settings.target_parameters}: {missed} matches no parameter of "
            f"{type(model).__name__}"
            + (f"; its fused expert weights are {three_d} ({ALL_EXPERTS} names them all)" if three_d else "")
        )
    adapted = sorted({layer_suffix(f) for f in full})
    route_expert_lora(wrapped)  # under expert parallel a rank adds the deltas of its own experts only
    if adapted:
        logger.info(
            "LoRA on parameters (PEFT's target_parameters; a fused MoE expert weight gets one low-rank pair per "
            "expert): %s",
            ", ".join(adapted),
        )
    return wrapped


def _param_suffix(name: str) -> str:
    return layer_suffix(name.replace(".base_layer", ""))


def _lora_error(
    model: torch.nn.Module, settings: LoraSettings, err: ValueError, linears: set[str], parts: tuple[str, ...]
) -> LoraError:
    """PEFT's refusal as a :class:`LoraError` that names the fix."""
    text = str(err)
    if "ParamWrapper" in text and "lora_dropout" in text:
        try:
            experts = expert_targets(model)
        except ValueError:
            experts = []
        return LoraError(
            f"lora_dropout={settings.dropout} with LoRA on parameters: "
            + (
                f"PEFT extends lora_target_modules={settings.target_modules} on {type(model).__name__} to its fused "
                f"MoE experts{' (' + ', '.join(experts) + ')' if experts else ''} and router weight, "
                if not settings.target_parameters
                else ""
            )
            + "which it adapts as parameters (B @ A added to the weight), so there is no adapter input to drop out; "
            "set lora_dropout: 0 (or list lora_target_modules without the experts, e.g. [q_proj, k_proj, v_proj, "
            "o_proj])"
        )
    if settings.target_parameters and "no parameter was matched" in text:
        three_d = sorted({_param_suffix(n) for n, p in model.named_parameters() if p.dim() == 3})
        return LoraError(
            f"lora_target_parameters={settings.target_parameters}: {settings.target_parameters} matches no parameter "
            f"of {type(model).__name__}"
            + (f"; its fused expert weights are {three_d} ({ALL_EXPERTS} names them all)" if three_d else "")
        )
    names = sorted({n.rsplit(".", 1)[-1] for n in linears if not under(parts, n)})
    where = (
        "the language model's linear module names (the vision tower and projector take no adapter)"
        if parts
        else "the model's linear module names"
    )
    return LoraError(
        f"PEFT could not apply LoRA with lora_target_modules={settings.target_modules}: {err}; "
        f"{where} are {names} (or use all-linear)"
    )


def memory_report(model: torch.nn.Module) -> dict[str, float]:
    """Trainable vs total parameters and the AdamW state size (global, unsharded sizes).

    Args:
        model: the (PEFT-wrapped) model, before or after sharding (DTensor sizes are global).

    Returns:
        ``total_params``, ``trainable_params``, ``trainable_fraction``, ``param_bytes`` (all
        parameters in their dtypes), ``trainable_bytes`` and ``optimizer_state_bytes`` (AdamW: two
        moments per trainable parameter in its dtype).
    """
    total = trainable = param_bytes = trainable_bytes = 0
    for p in model.parameters():
        n = p.numel()
        total += n
        param_bytes += n * p.element_size()
        if p.requires_grad:
            trainable += n
            trainable_bytes += n * p.element_size()
    return {
        "total_params": total,
        "trainable_params": trainable,
        "trainable_fraction": trainable / max(total, 1),
        "param_bytes": param_bytes,
        "trainable_bytes": trainable_bytes,
        "optimizer_state_bytes": 2 * trainable_bytes,
    }


def format_memory_report(report: dict[str, float], world_size: int) -> str:
    """One log line from :func:`memory_report`."""
    return (
        f"LoRA: {report['trainable_params'] / 1e6:.2f}M trainable of {report['total_params'] / 1e6:.1f}M parameters "
        f"({100 * report['trainable_fraction']:.2f}%); parameters {report['param_bytes'] / 2**20:.1f} MiB, "
        f"trainable fp32 {report['trainable_bytes'] / 2**20:.2f} MiB, AdamW state "
        f"{report['optimizer_state_bytes'] / 2**20:.2f} MiB in all, "
        f"{report['optimizer_state_bytes'] / world_size / 2**20:.2f} MiB per rank (sharded over {world_size})"
    )


def reshard(model: torch.nn.Module) -> None:
    """Return every FSDP2 unit to its sharded state (no communication).

    Units kept unsharded after a forward (the root and the tail group use ``reshard_after_forward=False``)
    expose full plain tensors as their parameters; readers of local shards need the sharded DTensors.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
