"""FP8 training of the decoder layers' linears with torchao's float8 (``mixed_precision: fp8``).

torchtitan's recipe, applied to a loaded model by explicit functions, in the house order (float8 -> tp -> ac ->
compile -> fsdp): :func:`convert_float8` swaps the decoder layers' ``nn.Linear`` for torchao's ``Float8Linear``
before ``fully_shard``; with ``fp8_all_gather`` (tensorwise scaling) FSDP2 all-gathers those weights as float8
bytes (half of bf16's traffic), and :func:`register_scale_precompute` computes their scales once per optimizer
step for every layer in one pass (torchao's ``precompute_float8_dynamic_scale_for_fsdp``), right after the step.

What stays in bf16: the LM head, the embeddings, norms, MoE routers (small matmuls whose rounding moves the
expert choice) and LoRA adapters (LoRA + FP8 is refused: ``hf_fsdp2.config.parse``), linears whose dimensions
are not multiples of 16 (``torch._scaled_mm`` cannot take them) and, with ``fp8_size_filter`` (the default),
linears below torchao's size thresholds, where float8 is slower than bf16 (:func:`below_float8_size`: Llama-3-8B's
``k_proj``/``v_proj``); both listed in the log.

Why not accelerate's ``mixed_precision="fp8"`` (``AORecipeKwargs``): its ``prepare`` converts every ``nn.Linear``
but the first and the last one of the model, routers and adapters included, after hf_fsdp2's activation
checkpointing and compile have wrapped the layers. The conversion and the precompute hook are the same torchao
calls accelerate makes, made here at the right point with the right filter; the Accelerator gets ``bf16``, the
dtype of everything not converted.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_fsdp2.config.float8 import Float8Plan
from hf_fsdp2.config.plans import ConfigError

logger = logging.getLogger("hf_fsdp2")

# torch._scaled_mm needs both dimensions of a float8 matmul's weight divisible by 16.
FP8_DIM_MULTIPLE = 16
# Linears that stay in bf16 inside a decoder layer, by the last part of their name: MoE routers and gates.
ROUTER_NAMES = ("gate", "router", "shared_expert_gate")
# Hopper (sm_90) is the first NVIDIA architecture with FP8 tensor cores torchao uses (Ada's sm_89 has them too).
FP8_MIN_CAPABILITY = (8, 9)


def below_float8_size(scaling: str, out_features: int, in_features: int) -> str | None:
    """Why a linear of weight shape ``(out_features, in_features)`` (N, K) is faster in bf16 than in float8 under
    ``scaling`` (the FP8 recipe: tensorwise or rowwise); None when float8 pays.

    torchao's auto filter (``torchao.float8._auto_filter_for_recipe``, which torchtitan's float8 converter applies
    with ``filter_fqns = ["auto_filter_small_kn"]``), the same thresholds: a float8 linear casts its input, weight
    and output gradient (an amax reduction, a scale and a cast each: memory-bound passes over M x K, N x K and
    M x N elements) around each of its three matmuls, and below these sizes the matmuls' gain on FP8 tensor cores is
    smaller than those passes cost (torchao's H100 benchmarks of each recipe). Rowwise scaling has a slower matmul
    kernel and per-row scales, hence larger thresholds. At Llama-3-8B's shapes tensorwise keeps ``k_proj``/``v_proj``
    (N = 1024, K = 4096) in bf16 and converts q/o (4096 x 4096), gate/up (14336 x 4096) and down (4096 x 14336).
    """
    n, k = out_features, in_features
    if scaling == "rowwise":
        if n <= 2048:
            return "out_features <= 2048"
        if k <= 1024:
            return "in_features <= 1024"
        if n <= 4096 and k <= 2048:
            return "out_features <= 4096 and in_features <= 2048"
        return None
    if k <= 4096 and n <= 1024:
        return "out_features <= 1024 and in_features <= 4096"
    return None


def float8_linear_config(plan: Float8Plan) -> Any:
    """torchao's ``Float8LinearConfig`` for ``plan`` (its recipe, emulation and float8 all-gather)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig

    base = Float8LinearConfig.from_recipe_name(plan.recipe)
    return dataclasses.replace(base, emulate=plan.emulate, enable_fsdp_float8_all_gather=plan.all_gather)


def fp8_hardware_problem(
    device_type: str, capability: tuple[int, int] | None, device_name: str = ""
) -> str | None:
    """Why this device cannot run FP8 matmuls (None: it can).

    Args:
        device_type: ``"cuda"`` or ``"cpu"``.
        capability: the CUDA compute capability (major, minor); None on CPU.
        device_name: for the message.
    """
    if device_type != "cuda" or capability is None:
        return (
            f"no FP8 matmul hardware on {device_type} (FP8 needs an NVIDIA GPU of compute capability >= 8.9)"
        )
    if tuple(capability) < FP8_MIN_CAPABILITY:
        major, minor = capability
        return (
            f"{device_name or 'this GPU'} (compute capability {major}.{minor}) has no FP8 tensor cores "
            "(Ada sm_89, Hopper sm_90 and later have)"
        )
    return None


def check_float8_hardware(plan: Float8Plan, device: torch.device) -> str | None:
    """Refuse ``mixed_precision=fp8`` where it cannot run, unless emulated.

    Returns:
        A warning line when the run is emulated (slow), else None.

    Raises:
        ConfigError: no FP8 hardware and ``fp8_emulate`` is false.
    """
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    problem = fp8_hardware_problem(device.type, capability, name)
    if plan.emulate:
        return (
            "fp8_emulate=true: torchao emulates the float8 rounding in high precision; the numerics of FP8, "
            "none of its speed (for tests and debugging)"
        )
    if problem is not None:
        raise ConfigError(
            f"mixed_precision=fp8: {problem}; use mixed_precision=bf16, or set fp8_emulate=true to emulate the "
            "float8 rounding (slow; for tests and debugging)"
        )
    return None


@dataclass(kw_only=True)
class Float8Report:
    """What :func:`convert_float8` did, by module name."""

    converted: list[str] = field(default_factory=list)
    shape_skipped: list[tuple[str, tuple[int, int]]] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # routers and adapters: bf16 by design
    # below torchao's size thresholds (fp8_size_filter): (name, (out, in), the threshold that keeps it)
    size_skipped: list[tuple[str, tuple[int, int], str]] = field(default_factory=list)
    float8_params: int = 0  # weight elements held as float8-cast weights

    def describe(self, plan: Float8Plan) -> str:
        """The start-of-run log lines."""
        lines = [
            f"FP8 ({plan.recipe}{', emulated' if plan.emulate else ''}): {len(self.converted)} decoder-layer "
            f"linears in float8 ({self.float8_params / 1e6:.2f}M weights), all-gather "
            f"{'float8' if plan.all_gather else 'bf16'}; head, embeddings, norms in bf16"
        ]
        if self.kept:
            lines.append(
                f"FP8: kept in bf16 (router/adapter): {', '.join(self.kept[:8])}"
                f"{' ...' if len(self.kept) > 8 else ''}"
            )
        if self.size_skipped:
            lines.append(
                f"FP8: kept in bf16, below torchao's {plan.recipe} size thresholds (float8 is slower than bf16 there; "
                f"fp8_size_filter=false converts them): {_by_layer_name(self.size_skipped)}"
            )
        if self.shape_skipped:
            listed = ", ".join(f"{n} {s}" for n, s in self.shape_skipped)
            lines.append(f"FP8: left in bf16, dimensions not multiples of {FP8_DIM_MULTIPLE}: {listed}")
        return "\n".join(lines)


def _by_layer_name(skipped: Sequence[tuple[str, tuple[int, int], str]]) -> str:
    """``self_attn.k_proj (1024, 4096) x32, self_attn.v_proj (1024, 4096) x32 (out_features <= 1024 and ...)``: one
    entry per name inside a decoder layer (everything up to the layer's index taken off) with the number of layers,
    grouped by the threshold that keeps them, not 64 full names for a 32-layer model."""
    groups: dict[str, dict[tuple[str, tuple[int, int]], int]] = {}
    for name, shape, why in skipped:
        inner = (re.sub(r"^.*?\.\d+\.", "", name), shape)
        groups.setdefault(why, {})[inner] = groups.setdefault(why, {}).get(inner, 0) + 1
    return "; ".join(
        ", ".join(f"{inner} {shape} x{count}" for (inner, shape), count in names.items()) + f" ({why})"
        for why, names in groups.items()
    )


def _in_decoder_layers(model: torch.nn.Module, layer_cls_names: Sequence[str]) -> list[str]:
    prefixes = [name for name, mod in model.named_modules() if type(mod).__name__ in layer_cls_names]
    return [p + "." for p in prefixes]


def plan_float8(
    model: torch.nn.Module, layer_cls_names: Sequence[str], recipe: str, size_filter: bool
) -> Float8Report:
    """Which linears :func:`convert_float8` converts: every ``nn.Linear`` inside a decoder layer whose dimensions
    are multiples of 16, except routers and LoRA adapters and, with ``size_filter``, those below ``recipe``'s size
    thresholds (:func:`below_float8_size`). Nothing is changed."""
    report = Float8Report()
    prefixes = _in_decoder_layers(model, layer_cls_names)
    for name, mod in model.named_modules():
        if type(mod) is not torch.nn.Linear or not any(name.startswith(p) for p in prefixes):
            continue
        leaf = name.rsplit(".", 1)[-1]
        shape = (mod.out_features, mod.in_features)
        small = below_float8_size(recipe, *shape) if size_filter else None
        if leaf in ROUTER_NAMES or "lora_" in name or ".base_layer" in name:
            report.kept.append(name)
        elif mod.in_features % FP8_DIM_MULTIPLE or mod.out_features % FP8_DIM_MULTIPLE:
            report.shape_skipped.append((name, shape))
        elif small is not None:
            report.size_skipped.append((name, shape, small))
        else:
            report.converted.append(name)
            report.float8_params += mod.weight.numel()
    return report


def convert_float8(model: torch.nn.Module, layer_cls_names: Sequence[str], plan: Float8Plan) -> Float8Report:
    """Swap the decoder layers' eligible linears (:func:`plan_float8`) for torchao's ``Float8Linear``, in place,
    before activation checkpointing, compile and ``fully_shard``. The weights stay in their dtype (fp32 masters);
    float8 is the matmuls' operands (and the all-gather's bytes with ``plan.all_gather``).

    Raises:
        ConfigError: no decoder-layer linear can be converted (nothing would run in FP8).
    """
    from torchao.float8 import convert_to_float8_training

    report = plan_float8(model, layer_cls_names, plan.recipe, plan.size_filter)
    if not report.converted and report.size_skipped:
        raise ConfigError(
            f"mixed_precision=fp8 but every decoder-layer linear of {type(model).__name__} is below torchao's "
            f"{plan.recipe} size thresholds, where float8 is slower than bf16 "
            f"({_by_layer_name(report.size_skipped[:4])}); use mixed_precision=bf16, or fp8_size_filter=false to "
            "convert them anyway (tests of FP8's numerics on small models)"
        )
    if not report.converted:
        raise ConfigError(
            f"mixed_precision=fp8 but no decoder-layer linear of {type(model).__name__} can run in FP8 (dimensions "
            f"must be multiples of {FP8_DIM_MULTIPLE}; left out: {report.shape_skipped[:4]}); use mixed_precision=bf16"
        )
    wanted = set(report.converted)
    keep: Callable[[torch.nn.Module, str], bool] = lambda _mod, fqn: fqn in wanted  # noqa: E731
    convert_to_float8_training(model, module_filter_fn=keep, config=float8_linear_config(plan))
    return report


def float8_all_gather_over_bytes(model: torch.nn.Module) -> int:
    """On gloo (CPU, emulated FP8): let FSDP2 all-gather a unit whose every input is float8 as bytes.

    FSDP2 packs a unit's all-gather inputs into one buffer, of uint8 when their dtypes differ (a decoder layer's
    float8 weights beside its bf16 norms) but of float8 when all are float8, and gloo has no float8 type. The
    custom all-gather sends the same bytes as uint8 (NCCL takes float8 and needs none of this).

    Returns:
        The number of FSDP units given the byte all-gather.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    class BytesAllGather(DefaultAllGather):
        def __call__(
            self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False
        ) -> Any:
            if output_tensor.dtype.itemsize == 1:  # float8 or uint8: the same bytes
                output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
            return super().__call__(output_tensor, input_tensor, group, async_op)

    count = 0
    for mod in model.modules():
        if isinstance(mod, FSDPModule):
            mod.set_custom_all_gather(BytesAllGather())
            count += 1
    return count


def register_scale_precompute(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """After every optimizer step, compute the float8 scales of every converted weight in one pass (torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``: one all-reduce of all amaxes instead of one per weight inside
    each layer's all-gather). Every rank steps, so every rank takes part. A skipped step (the non-finite guard)
    changes no weight and needs none; a checkpoint load computes them again. Returns the step hook's handle."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    def precompute(*_args: Any, **_kwargs: Any) -> None:
        precompute_float8_dynamic_scale_for_fsdp(model)

    # A checkpoint load replaces the weights after their scales were computed (the loader's own optimizer step, which
    # creates the optimizer state, computed them from the weights it then replaces): computed again from what was
    # loaded. Every rank loads, so every rank takes part.
    model.register_load_state_dict_post_hook(lambda _module, _keys: precompute())
    inner = getattr(
        optimizer, "optimizer", optimizer
    )  # accelerate's AcceleratedOptimizer steps the torch one
    return inner.register_step_post_hook(precompute)


def float8_weight_names(model: torch.nn.Module) -> list[str]:
    """Names of the parameters FSDP2 all-gathers as float8 (torchao's float8-cast weight wrapper)."""
    from torch.distributed.tensor import DTensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    names = []
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        if isinstance(local, WeightWithDynamicFloat8CastTensor):
            names.append(name)
    return names


def finish_float8(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, plan: Float8Plan, device: torch.device
) -> str:
    """After ``fully_shard``: with float8 all-gather, the scale precompute after each optimizer step and (gloo) the
    byte all-gather. Every rank calls it. Returns the line for the log."""
    if not plan.all_gather:
        return "FP8: weights all-gathered in bf16 (fp8_all_gather=false), cast to float8 per matmul"
    register_scale_precompute(model, optimizer)
    if device.type == "cpu":
        float8_all_gather_over_bytes(model)
    names = float8_weight_names(model)
    return (
        f"FP8: FSDP2 all-gathers {len(names)} weights as float8 (1 byte per element); their scales are computed "
        "for every layer at once after each optimizer step"
    )


def warn_without_compile(compiled: bool) -> str | None:
    """The warning for FP8 without torch.compile (None when compiled): torchao's casts and scaling are separate
    kernels in eager mode, which eat the matmul's gain."""
    if compiled:
        return None
    return (
        "mixed_precision=fp8 without torch_compile: torchao's float8 casts and scales run as separate eager kernels "
        "and are usually slower than bf16; set torch_compile=true (per-layer compile fuses them)"
    )


def without_float8_wrapper(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with torchao's float8-cast weight wrapper taken off (the same values and storage, a plain tensor or
    a DTensor of one); any other tensor unchanged. For readers of raw bytes (the safetensors export): the wrapper
    has no storage of its own."""
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if not type(local).__module__.startswith("torchao."):  # no run without FP8 imports torchao here
        return tensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    if not isinstance(local, WeightWithDynamicFloat8CastTensor):
        return tensor
    inner = local._tensor
    if isinstance(tensor, DTensor):
        return DTensor.from_local(
            inner,
            tensor.device_mesh,
            tensor.placements,
            run_check=False,
            shape=tensor.shape,
            stride=tensor.stride(),
        )
    return inner
