"""LoRA on the fused experts of a mixture of experts, through PEFT's ``target_parameters`` (its ``ParamWrapper``).

transformers 5 holds the routed experts of an MoE layer in one module whose weights are 3-D tensors
(``gate_up_proj`` ``[experts, 2 x inter, hidden]``, ``down_proj`` ``[experts, hidden, inter]``; gpt-oss stores them
transposed): not ``nn.Linear`` modules, so ``lora_target_modules`` cannot name them. PEFT adapts such a weight as a
parameter: ``lora_A`` ``[r x experts, in]`` and ``lora_B`` ``[out, r x experts]``, one rank-``r`` pair per expert,
added to the weight itself for each forward. This module holds what the project adds to it:

- the alias ``all-experts`` of ``lora_target_parameters``: every fused expert weight of the model
  (:func:`expert_targets`), by the suffix PEFT matches (``mlp.experts.gate_up_proj``);
- which LoRA layers adapt a parameter, and the name of the weight each adapts (:func:`adapted_weight`);
- the merge of one such layer on this rank's experts (:func:`local_expert_delta`): ``W_e + scale x B_e @ A_e`` per
  expert held, from the whole (small) ``A`` and ``B``; no rank gathers the base.
"""

from __future__ import annotations

import re
from typing import Any

import torch

# The alias a recipe writes in lora_target_parameters for every fused expert weight of the model.
ALL_EXPERTS = "all-experts"

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.\d+\.")


def is_fused_experts(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a transformers experts module with fused 3-D weights (a ``@use_experts_implementation``
    class: its ``__init__`` sets ``has_gate``, ``is_transposed`` and ``is_concatenated``)."""
    return all(hasattr(module, key) for key in ("has_gate", "is_transposed", "is_concatenated")) and any(
        p.dim() == 3 for p in module.parameters(recurse=False)
    )


def fused_experts(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Every fused experts module of ``model`` (PEFT's wrappers looked through), by module name."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    found = []
    for name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer):
            continue
        if is_fused_experts(module):
            found.append((name, module))
    return found


def layer_suffix(name: str) -> str:
    """A module or parameter name relative to its decoder layer (``model.layers.3.mlp.experts`` -> ``mlp.experts``)."""
    ends = [m.end() for m in _LAYER_INDEX.finditer(name)]
    return name[ends[-1] :] if ends else name


def expert_targets(model: torch.nn.Module) -> list[str]:
    """The ``target_parameters`` that ``all-experts`` stands for: each fused expert weight (3-D; gpt-oss's biases,
    2-D, are not adapted and stay frozen), by its name relative to the decoder layer, sorted.

    Raises:
        ValueError: the model has no fused experts module (a dense model, or experts transformers does not fuse).
    """
    names = {
        layer_suffix(f"{module_name}.{pname}")
        for module_name, module in fused_experts(model)
        for pname, param in module.named_parameters(recurse=False)
        if param.dim() == 3
    }
    if not names:
        three_d = sorted({layer_suffix(n) for n, p in model.named_parameters() if p.dim() == 3})
        raise ValueError(
            f"lora_target_parameters: {ALL_EXPERTS}: {type(model).__name__} has no fused MoE experts module (a "
            "transformers experts class with 3-D weights, as Qwen3-MoE, Mixtral, OLMoE and gpt-oss have)"
            + (
                f"; its 3-D parameters are {three_d}: name them in lora_target_parameters instead"
                if three_d
                else "; it is not a mixture of experts: leave lora_target_parameters empty"
            )
        )
    return sorted(names)


def resolve_target_parameters(model: torch.nn.Module, names: list[str] | None) -> list[str] | None:
    """``lora_target_parameters`` with ``all-experts`` expanded (:func:`expert_targets`); None when empty."""
    if not names:
        return None
    out: list[str] = []
    for name in names:
        for target in expert_targets(model) if name == ALL_EXPERTS else [name]:
            if target not in out:
                out.append(target)
    return out


def is_param_wrapper(layer: Any) -> bool:
    """Whether a LoRA layer adapts a parameter (PEFT's ``ParamWrapper``) rather than a module's input."""
    from peft.tuners.lora.layer import ParamWrapper

    return isinstance(layer, ParamWrapper)


def adapted_weight(module_name: str, layer: Any) -> str:
    """The plain base model's name of the weight a LoRA layer adapts: ``<module>.weight`` for a linear,
    ``<module>.<parameter>`` for a parameter (nested ``ParamWrapper``s share the module: ``.base_layer`` dropped)."""
    base = module_name.removeprefix("base_model.model.").replace(".base_layer", "")
    return f"{base}.{layer.parameter_name}" if is_param_wrapper(layer) else f"{base}.weight"


def local_expert_delta(
    layer: Any,
    adapter: str,
    a_full: torch.Tensor,
    b_full: torch.Tensor,
    first: int,
    count: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``scale x B_e @ A_e`` for experts ``first .. first + count - 1`` of a 3-D ``ParamWrapper``, laid out as the
    weight is (``[count, out, in]``, or ``[count, in, out]`` for a transposed weight), in ``dtype``.

    PEFT's layout (``ParamWrapper.get_delta_weight``): ``A`` ``[r x E, in]`` holds expert ``e``'s rows at
    ``e x r .. e x r + r - 1``; ``B`` ``[out, r x E]`` its columns at ``j x E + e``.

    Args:
        layer: the ``ParamWrapper``.
        adapter: the adapter name.
        a_full, b_full: the whole ``lora_A`` and ``lora_B`` weights.
        first, count: the experts this rank holds.
        dtype: the accumulation dtype (fp32, or fp64 for fp64 weights).
    """
    experts = layer.num_experts
    a = a_full.to(dtype).reshape(experts, -1, a_full.shape[-1])[first : first + count]  # [count, r, in]
    b = b_full.to(dtype).reshape(b_full.shape[0], -1, experts)[:, :, first : first + count]  # [out, r, count]
    pattern = "o r e, e r i -> e o i" if layer._did_swap_in_out_features else "o r e, e r i -> e i o"
    return torch.einsum(pattern, b, a) * float(layer.scaling[adapter])


class _ScaleGrad(torch.autograd.Function):
    """The identity, whose backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def _wrapper_chain(layer: Any) -> list[Any]:
    """The nested ``ParamWrapper``s from ``layer`` inwards (one per adapted parameter of the module)."""
    chain = []
    while is_param_wrapper(layer):
        chain.append(layer)
        layer = layer.base_layer
    return chain


def _local_merged(wrapper: Any, weight: Any) -> torch.Tensor:
    """This rank's block of ``weight`` (a DTensor ``Shard(0)`` over the ep mesh: whole, consecutive experts) with the
    active adapters' deltas of those experts added, as a DTensor of the same placement.

    The deltas' gradient is scaled by ``ep`` on its way back: expert parallel multiplies the gradient of every
    tensor its forward reads by ``1 / ep`` (an expert's gradient sums the tokens of its ep group while FSDP2 averages
    it over ``W / ep`` ranks), but ``lora_A`` and ``lora_B`` are not expert tensors: FSDP2 averages their gradient over
    all ``W`` ranks, to which each rank brings the pairs of the experts it holds (zero for the others)."""
    from torch.distributed.tensor import DTensor

    local = weight.to_local()
    mesh = weight.device_mesh
    ep = mesh.size()
    count = local.shape[0]
    first = mesh.get_local_rank() * count
    merged = local
    for adapter in wrapper.active_adapters:
        if adapter not in wrapper.lora_A:
            continue
        lhs, rhs, scaling = wrapper.get_delta_factors(adapter)
        delta = torch.bmm(
            lhs[first : first + count].to(local.dtype), rhs[first : first + count].to(local.dtype)
        )
        merged = merged + _ScaleGrad.apply(delta * scaling, float(ep))
    return DTensor.from_local(merged, mesh, weight.placements, shape=weight.shape, stride=weight.stride())


def lora_experts_forward(wrapper: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The forward of a LoRA ``ParamWrapper`` over fused experts: PEFT's own, unless the experts are split by expert
    parallel (their tensors, as FSDP2 hands them to the forward, DTensors over the ep mesh), where PEFT's
    parametrisation would add every expert's delta to this rank's block (:func:`_expert_parallel_call`)."""
    from torch.distributed.tensor import DTensor

    chain = _wrapper_chain(wrapper)
    if wrapper.disable_adapters or wrapper.merged or not isinstance(chain[0].get_param(), DTensor):
        return type(wrapper).forward(wrapper, x, *args, **kwargs)
    return _expert_parallel_call(chain, x, *args, **kwargs)


@torch.compiler.disable  # as expert parallel's own forward: eager inside a compiled decoder layer
def _expert_parallel_call(chain: list[Any], x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Each adapted tensor of the experts module replaced, for the call, by its block plus the deltas of its experts
    (:func:`_local_merged`); the experts module runs (its expert-parallel implementation reads its tensors), then
    gets its own tensors back."""
    base = chain[-1].base_layer
    originals = {w.parameter_name: base._parameters[w.parameter_name] for w in chain}
    try:
        for w in chain:
            # Not nn.Module.__setattr__: the merged block is not a leaf (FSDP2 swaps its tensors the same way).
            base._parameters[w.parameter_name] = _local_merged(w, originals[w.parameter_name])
        return base(x, *args, **kwargs)
    finally:
        base._parameters.update(originals)


def route_expert_lora(model: torch.nn.Module) -> int:
    """Give the outermost LoRA ``ParamWrapper`` of every fused experts module :func:`lora_experts_forward` (an
    instance attribute: PEFT's own forward runs unless the experts are split by expert parallel). Returns the
    experts modules routed."""
    import types

    count = 0
    for name, module in model.named_modules():
        if not is_param_wrapper(module) or name.endswith(".base_layer"):
            continue
        chain = _wrapper_chain(module)
        if is_fused_experts(chain[-1].base_layer):
            module.forward = types.MethodType(lora_experts_forward, module)
            count += 1
    return count
