"""Tensor parallel: the family's own plan (transformers' ``config.base_model_tp_plan``) applied to a loaded model
with torch's DTensor styles, on the ``tp`` dimension of the run's mesh, before ``fully_shard`` (torchtitan's
``parallelize_llama`` order: tp -> ac -> compile -> fsdp).

What each style becomes (torch.distributed.tensor.parallel):

- ``colwise`` (q/k/v, gate/up): ``ColwiseParallel``: the weight's output rows split over the tp ranks, the input
  replicated, the output this rank's heads / intermediate columns (a plain local tensor, so the attention and the
  activation run on local heads unchanged: the HF reshapes use ``-1`` heads, and ``num_key_value_groups`` is a ratio
  that the split keeps).
- ``rowwise`` (o, down): ``RowwiseParallel``: the weight's input columns split, the partial outputs all-reduced
  (the only forward collective of a layer besides the one in the backward of ``colwise``).
- ``replicated_with_grad_allreduce`` (Qwen3's per-head ``q_norm`` / ``k_norm``): the weight replicated, the input
  marked as sharded over its heads dim, so the weight's gradient is partial over the tp ranks and FSDP2 sums it
  (it redistributes a gradient to its parameter's placements before the reduce-scatter).

Every other parameter (embeddings, norms, the output head) is replicated over tp as a DTensor (torchtitan's
``NoParallel``, accelerate's ``_prepare_tp``): FSDP2 then shards every parameter over the data dimensions of one
mesh, so gradient clipping, the checkpoint and the export see one kind of tensor (2-D: data x tp). The output head
stays whole on every tp rank (no loss parallel): the chunked loss runs on it unchanged, at the memory of one head per
rank, the same as without TP.

Not every plan can run: transformers' styles for fused expert tensors (``packed_colwise``, ``moe_tp_experts``) have no
torch equivalent, so MoE families are refused (:func:`tp_plan_for`).
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

# Plan styles this version applies, and what each becomes (see the module docstring).
STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")


class TensorParallelError(ValueError):
    """A model or setting tensor parallel cannot run; the message names the reason and the fix."""


@dataclass(frozen=True)
class TensorParallelPlan:
    """The plan of one model: module name -> style, each a module of the model (wildcards expanded)."""

    family: str
    styles: dict[str, str]

    def describe(self, tp: int) -> str:
        counts: dict[str, int] = {}
        for style in self.styles.values():
            counts[style] = counts.get(style, 0) + 1
        split = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        return (
            f"tensor parallel {tp} ({self.family}'s base_model_tp_plan through torch DTensor styles): {split} "
            "modules split over the tp ranks; embeddings, norms and the output head replicated over tp (the head "
            "whole on every tp rank, no loss parallel: the chunked loss runs on it as without TP, at one head's "
            "memory per rank)"
        )


def tp_plan_for(model: nn.Module) -> TensorParallelPlan:
    """The model's tensor-parallel plan: transformers' ``config.base_model_tp_plan`` with its wildcards expanded to
    this model's module names (under ``base_model_prefix``).

    Raises:
        TensorParallelError: the family has no plan, the plan has a style this version cannot apply (MoE experts), a
            plan entry matches no module, or a ``replicated_with_grad_allreduce`` module does not normalise per head.
    """
    config = getattr(model, "config", None)
    family = str(getattr(config, "model_type", type(model).__name__))
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not plan:
        raise TensorParallelError(
            f"tp_size>1: {type(model).__name__} (model_type {family!r}) has no tensor-parallel plan (transformers' "
            "config.base_model_tp_plan is empty for it), so there is nothing to split; use tp_size=1 (FSDP2 or HSDP "
            "shards it over the data ranks)"
        )
    unsupported = sorted({s for s in plan.values() if s not in STYLES})
    if unsupported:
        raise TensorParallelError(
            f"tp_size>1: {family}'s base_model_tp_plan uses {unsupported}, transformers' own styles for fused "
            f"expert tensors (and others) that have no torch DTensor equivalent; this version applies {list(STYLES)} "
            "only, so MoE families are not split; use tp_size=1 for this model"
        )
    prefix = getattr(model, "base_model_prefix", "") or ""
    names = [n for n, _ in model.named_modules()]
    if prefix and not any(n.startswith(prefix + ".") for n in names):
        prefix = ""  # the model is its own base model
    # transformers 5.25 moved MoE experts out of the TP plan (into base_model_ep_plan): the plan above no longer names
    # them, and its dense-MLP entries match nothing in an all-MoE model. Experts stay refused by name either way.
    experts = [n for n in names if n.endswith(".experts")]
    if experts:
        raise TensorParallelError(
            f"tp_size>1: {family} is a mixture-of-experts model ({len(experts)} expert blocks, e.g. {experts[0]}); "
            "this version splits attention and dense MLPs only, not experts, so MoE families are not split; use "
            "tp_size=1 for this model"
        )
    styles: dict[str, str] = {}
    for pattern, style in plan.items():
        full = f"{prefix}.{pattern}" if prefix else pattern
        hits = [n for n in names if fnmatch.fnmatchcase(n, full)]
        if not hits:
            raise TensorParallelError(
                f"tp_size>1: {family}'s base_model_tp_plan entry {pattern!r} matches no module of "
                f"{type(model).__name__} (looked for {full!r}); a wrapped model (LoRA) or renamed modules cannot be "
                "split; use tp_size=1"
            )
        styles.update(dict.fromkeys(hits, style))
    head_dim = _head_dim(config)
    for name, style in styles.items():
        if style == "replicated_with_grad_allreduce":
            weight = getattr(model.get_submodule(name), "weight", None)
            if weight is None or weight.ndim != 1 or weight.shape[0] != head_dim:
                raise TensorParallelError(
                    f"tp_size>1: {name} ({style}) does not normalise each head on its own (weight "
                    f"{tuple(weight.shape) if weight is not None else None}, head_dim {head_dim}); this version "
                    "splits such norms over heads only; use tp_size=1"
                )
    return TensorParallelPlan(family, styles)


def _head_dim(config: Any) -> int | None:
    head_dim = getattr(config, "head_dim", None)
    if head_dim:
        return int(head_dim)
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    return int(hidden) // int(heads) if hidden and heads else None


def _replicate_params(done: dict[int, nn.Parameter], name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """``distribute_module``'s partition function: each direct parameter replicated over ``mesh`` (no communication:
    every rank loaded the same weights). ``done`` maps a parameter already converted to its DTensor, so a tied
    weight (embedding and head) stays one parameter."""
    for key, param in list(module._parameters.items()):
        if param is None or isinstance(param, DTensor):
            continue
        new = done.get(id(param))
        if new is None:
            local = DTensor.from_local(param.data, mesh, [Replicate()], run_check=False)
            new = nn.Parameter(local, requires_grad=param.requires_grad)
            done[id(param)] = new
        module.register_parameter(key, new)


def _to_dtensor(placement: Any, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    """Forward pre-hook: the first input as a DTensor on ``mesh`` with ``placement`` (``"heads"``: sharded over its
    heads dim, the second to last)."""
    if not inputs or not isinstance(inputs[0], torch.Tensor) or isinstance(inputs[0], DTensor):
        return inputs
    x = inputs[0]
    where = Shard(x.ndim - 2) if placement == "heads" else Replicate()
    return (DTensor.from_local(x, mesh, [where], run_check=False), *inputs[1:])


def _to_local(module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
    """Forward hook: a DTensor output back to this rank's local tensor (what the next HF module expects)."""
    return output.to_local() if isinstance(output, DTensor) else output


class _Replicated(ParallelStyle):
    """Parameters replicated over tp; the module computes on DTensors between its input and output (torchtitan's
    ``NoParallel``). ``heads``: the input is this rank's heads (a per-head norm after a colwise projection), so
    the weight's gradient is partial over tp (summed by FSDP2's redistribution to Replicate)."""

    def __init__(self, done: dict[int, nn.Parameter], *, heads: bool = False) -> None:
        self.done, self.heads = done, heads

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            functools.partial(_replicate_params, self.done),
            functools.partial(_to_dtensor, "heads" if self.heads else "replicate"),  # type: ignore[arg-type]
            _to_local,  # type: ignore[arg-type]
        )


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: TensorParallelPlan) -> str:
    """Split ``model`` over ``tp_mesh`` by ``plan`` and replicate its other parameters over it, in place (every rank
    of the mesh, no communication: each takes its part of the weights it loaded).

    Returns:
        The line for the log (what is split, what is replicated, where the head is).
    """
    done: dict[int, nn.Parameter] = {}
    styles: dict[str, ParallelStyle] = {}
    for name, style in plan.styles.items():
        if style == "colwise":
            styles[name] = ColwiseParallel()
        elif style == "rowwise":
            styles[name] = RowwiseParallel()
        else:
            styles[name] = _Replicated(done, heads=True)
    # src_data_rank=None: every rank slices its own copy (no broadcast of rank 0's weights).
    parallelize_module(model, tp_mesh, styles, src_data_rank=None)
    for name, module in model.named_modules():
        if name in plan.styles:
            continue
        if any(p is not None and not isinstance(p, DTensor) for p in module._parameters.values()):
            _Replicated(done)._apply(module, tp_mesh)
    return plan.describe(tp_mesh.size())


@contextlib.contextmanager
def tp_prepared_by_torch(accelerator: Any) -> Iterator[None]:
    """Within the block, ``accelerator.prepare`` does not run its own tensor-parallel preparation: accelerate 1.16's
    ``_prepare_tp`` imports ``transformers.integrations.tensor_parallel.ReplicateParallel``, which transformers 5
    removed (ImportError), and all it would do, replicating the parameters the plan leaves whole, is done already
    (:func:`apply_tensor_parallel`). Accelerate still builds the mesh (``ParallelismConfig(tp_size=...)``) and runs
    its FSDP2 prepare over the mesh's data dimensions (``dp_shard_cp``), which sees the tp DTensors and shards them
    2-D. A write to the public ``tp_size`` field of the accelerator's ``ParallelismConfig``, restored after."""
    config = getattr(accelerator, "parallelism_config", None)
    size = getattr(config, "tp_size", 1) or 1
    if config is None or size <= 1:
        yield
        return
    config.tp_size = 1
    try:
        if getattr(
            config, "tp_enabled", True
        ):  # this accelerate decides otherwise: its _prepare_tp would run
            raise RuntimeError(
                "accelerate's ParallelismConfig.tp_enabled no longer follows tp_size (accelerate "
                f"{_accelerate_version()}): its own tensor-parallel prepare would run on the split model; install the "
                "accelerate docs/compatibility.md lists as tested (pip install 'accelerate==1.16.*') or use tp_size=1"
            )
        yield
    finally:
        config.tp_size = size


def _accelerate_version() -> str:
    import accelerate

    return str(getattr(accelerate, "__version__", "?"))


def check_tp_settings(
    tp: int,
    *,
    use_peft: bool,
    load_in_4bit: bool,
    liger: bool,
    ram_efficient_loading: bool | None,
    torch_compile: bool | None,
    compile_default: bool,
) -> dict[str, str]:
    """Refuse what does not compose with tensor parallel yet, before any work.

    Args:
        tp: ``tp_size``.
        use_peft / load_in_4bit / liger: the run's LoRA, QLoRA and Liger settings.
        ram_efficient_loading / torch_compile: the recipe's values (None: unset).
        compile_default: whether an unset ``torch_compile`` would compile (a GPU is visible).

    Returns:
        The unset keys tensor parallel turns off -> the line for the log (empty without TP). The caller sets
        ``fsdp_cpu_ram_efficient_loading`` and ``torch_compile`` to false whenever ``tp > 1``.

    Raises:
        ConfigError: LoRA / QLoRA, Liger kernels, ``fsdp_cpu_ram_efficient_loading=true`` or ``torch_compile=true``
            with ``tp_size>1``.
    """
    from hf_fsdp2.config import ConfigError

    if tp <= 1:
        return {}
    if use_peft or load_in_4bit:
        raise ConfigError(
            f"tp_size={tp} with use_peft / load_in_4bit is not supported: LoRA wraps the linear layers the plan "
            "splits (torch's ColwiseParallel / RowwiseParallel split nn.Linear only); use tp_size=1 for LoRA runs"
        )
    if liger:
        raise ConfigError(
            f"tp_size={tp} with use_liger_kernel=true is not supported: Liger's kernels compute on plain tensors, "
            "and the tensor-parallel modules hold DTensors; set use_liger_kernel=false"
        )
    if ram_efficient_loading:
        raise ConfigError(
            f"tp_size={tp} with fsdp_cpu_ram_efficient_loading=true is not supported: Accelerate broadcasts rank 0's "
            "state dict, which holds only rank 0's tensor-parallel part of each split weight once the plan is "
            "applied; set fsdp_cpu_ram_efficient_loading=false (every rank loads the checkpoint, then keeps its part)"
        )
    compile_reason = (
        "torch 2.13's AOT tracing of a decoder layer holding DTensor tensor-parallel modules fails "
        "(BackendCompilerFailed: RecursionError: maximum recursion depth exceeded, measured on CPU/inductor)"
    )
    if torch_compile:
        raise ConfigError(
            f"tp_size={tp} with torch_compile=true is not supported in this version: {compile_reason}; set "
            "torch_compile=false"
        )
    off: dict[str, str] = {}
    if ram_efficient_loading is None:
        off["fsdp_cpu_ram_efficient_loading"] = (
            f"fsdp_cpu_ram_efficient_loading=false (tp_size={tp}: each rank loads the checkpoint and keeps its part "
            "of the split weights; Accelerate's rank-0 broadcast would carry rank 0's part only)"
        )
    if torch_compile is None and compile_default:
        off["torch_compile"] = f"torch_compile=false (tp_size={tp}: {compile_reason})"
    return off
