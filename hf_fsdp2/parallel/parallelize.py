"""The one place that states the order in which a loaded model is parallelized (torchtitan's ``parallelize_llama``).

:func:`parallelize` applies a :class:`ParallelPlan` to a model that is loaded, resized and wrapped with its adapters
(LoRA, QLoRA) and kernels (Liger), in this order, each step a small function with explicit arguments:

1. float8: torchao's ``Float8Linear`` in the decoder layers (torchtitan's order: converted before any split, so
   that tensor parallel splits float8 linears with torchao's float8 styles; before checkpointing and compile wrap
   them);
2. tensor parallel: the family's plan through torch's DTensor styles over the ``tp`` mesh (before anything else
   wraps the linears);
3. context parallel: the attention modules run the all-to-all (or ring) exchange over the cp group;
3b. expert parallel: each MoE layer's routed experts split over the ``ep`` ranks, tokens exchanged by all-to-all
   (:mod:`hf_fsdp2.parallel.expert_parallel`); the experts' load counted on every MoE model;
4. activation checkpointing of the decoder layers;
5. regional compile of each decoder layer, in place;
6. FSDP2: ``fully_shard`` per unit (each decoder layer; a composite's vision tower, whole or per block, and projector),
   then the root (through Accelerate, on the mesh and mixed-precision policy its plugin holds); under expert
   parallel a layer's experts on their own mesh within the layer's unit (:mod:`hf_fsdp2.parallel.expert_shard`);
7. whole-model compile, when asked instead of regional.

The optimizer is built afterwards on the
sharded parameters (:func:`hf_fsdp2.run.build.build_model`), and FP8's post-optimizer hook after it
(:func:`~hf_fsdp2.parallel.float8.finish_float8`). Parallelism never edits model code: every step wraps or swaps
modules of the loaded model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator
from torch.distributed.device_mesh import DeviceMesh

from hf_fsdp2.config.float8 import Float8Plan
from hf_fsdp2.config.plans import ACPlan, CompilePlan
from hf_fsdp2.parallel.accelerator import shard_with_accelerate
from hf_fsdp2.parallel.activations import apply_activation_checkpointing
from hf_fsdp2.parallel.all_to_all import enable_context_parallel
from hf_fsdp2.parallel.compiling import compile_model, compile_regions
from hf_fsdp2.parallel.expert_parallel import apply_expert_parallel
from hf_fsdp2.parallel.expert_shard import ExpertMeshes, rank0_state
from hf_fsdp2.parallel.experts import count_expert_load
from hf_fsdp2.parallel.float8 import convert_float8
from hf_fsdp2.parallel.ring import enable_ring_attention
from hf_fsdp2.parallel.tensor import TensorParallelPlan, apply_tensor_parallel

logger = logging.getLogger("hf_fsdp2")


@dataclass(frozen=True)
class TensorParallel:
    """Tensor parallel's step: the ``tp`` mesh and the family's plan (:func:`~hf_fsdp2.parallel.tensor.tp_plan_for`)."""

    mesh: DeviceMesh
    plan: TensorParallelPlan


@dataclass(frozen=True)
class ContextParallel:
    """Context parallel's step: the cp process group and size, the exchange (``all_to_all`` or ``ring``), and the
    tensor-parallel size (the heads each rank holds)."""

    group: Any
    size: int
    backend: str = "all_to_all"
    tp_size: int = 1


@dataclass(frozen=True)
class ExpertParallel:
    """Expert parallel's step: the experts' meshes, and whether rank 0 alone holds the weights (the other ranks on
    meta: ``fsdp_cpu_ram_efficient_loading``), whose whole tensors are then kept before the experts are split."""

    meshes: ExpertMeshes
    rank0_loading: bool = False


@dataclass(frozen=True, kw_only=True)
class ParallelPlan:
    """What :func:`parallelize` applies; None (or a disabled plan) skips a step.

    Attributes:
        layer_cls: the decoder-layer class names: what float8, checkpointing and regional compile wrap, and FSDP2's
            units.
        units: the class names FSDP2 makes one unit each, when more than ``layer_cls`` (empty: ``layer_cls``): a
            composite's vision tower and projector beside the text decoder layers
            (:func:`hf_fsdp2.model.fsdp_unit_classes`).
        tp: tensor parallel's step.
        cp: context parallel's step.
        ep: expert parallel's step.
        float8: the FP8 settings (``mixed_precision: fp8``).
        ac: activation checkpointing of the decoder layers.
        compile: torch.compile (regional or whole-model).
        frozen: a frozen copy beside the trained model (a reference): sharded alike, on the same mesh and policy,
            but not registered as the accelerator's model (Accelerate prepares one model under FSDP2).
    """

    layer_cls: tuple[str, ...]
    units: tuple[str, ...] = ()
    tp: TensorParallel | None = None
    cp: ContextParallel | None = None
    ep: ExpertParallel | None = None
    float8: Float8Plan | None = None
    ac: ACPlan = ACPlan()
    compile: CompilePlan = CompilePlan()
    frozen: bool = False


def parallelize(model: torch.nn.Module, accelerator: Accelerator, plan: ParallelPlan) -> torch.nn.Module:
    """Parallelize ``model`` by ``plan``, in the order of the module docstring; every rank calls it.

    Returns:
        The sharded model (Accelerate's FSDP2 module; compiled in place where asked).

    Raises:
        TensorParallelError, ContextParallelError, ConfigError: a step the model cannot take (each names why).
    """
    if plan.float8 is not None:
        logger.info("%s", convert_float8(model, plan.layer_cls, plan.float8).describe(plan.float8))
    if plan.tp is not None:
        logger.info("%s", apply_tensor_parallel(model, plan.tp.mesh, plan.tp.plan))
    if plan.cp is not None:
        logger.info("%s", apply_context_parallel(model, plan.cp))
    source = None
    if plan.ep is not None:
        if plan.ep.rank0_loading and accelerator.is_main_process:
            source = rank0_state(model)  # the whole experts, before they are split
        logger.info("%s", apply_expert_parallel(model, plan.ep.meshes.ep))
    count_expert_load(model, hooks=plan.ep is None and not plan.frozen)
    wrapped = apply_activation_checkpointing(model, plan.ac, plan.layer_cls)
    if wrapped:
        logger.info("activation checkpointing %s on %d decoder layers", plan.ac.mode, len(wrapped))
    if plan.compile.enabled and plan.compile.scope == "regional":
        compiled = compile_regions(model, plan.layer_cls, plan.compile)
        logger.info("regional compile: %d decoder layers compiled in place", len(compiled))
    model = shard_with_accelerate(
        accelerator,
        model,
        plan.units or plan.layer_cls,
        frozen=plan.frozen,
        experts=plan.ep.meshes if plan.ep is not None else None,
        source=source,
    )
    if plan.compile.enabled and plan.compile.scope == "model":
        logger.info("%s", compile_model(model, plan.compile))
    return model


def apply_context_parallel(model: torch.nn.Module, cp: ContextParallel) -> str:
    """Run the model's attention over the cp group: torch's ring attention (``ring``) or the all-to-all exchange.
    Returns the line the run logs."""
    if cp.backend == "ring":
        return enable_ring_attention(model, cp.group, cp.size)
    return enable_context_parallel(model, cp.group, cp.size, cp.tp_size)
