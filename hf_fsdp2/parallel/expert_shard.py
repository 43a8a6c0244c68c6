"""FSDP2 of an expert-parallel model: one ``fully_shard`` per decoder layer, the routed experts on their own mesh.

The layer stays one FSDP2 unit (one pre-forward hook, one post-backward, one state) whose parameters fall into two
groups by torch 2.13's per-parameter mesh (``shard_placement_fn`` returning a ``ShardPlacementResult``): every
parameter but the experts' keeps the run's mesh (``dp_shard x cp``, HSDP's ``dp_replicate x dp_shard x cp``), the
experts' fused tensors, already DTensors ``Shard(0)`` over ``ep`` (:mod:`hf_fsdp2.parallel.expert_parallel`), are
sharded over ``efsdp = dp_shard x cp / ep`` (and replicated over ``dp_replicate``). FSDP2 all-gathers each group
with its own collective, so per layer and step the experts move ``1/ep`` of what flat FSDP2 moves for them; their
global view is one DTensor on the mesh ``(dp_replicate,) efsdp x ep`` (``_StridedShard(0)`` over efsdp inside
``Shard(0)`` over ep: each rank holds whole, consecutive experts), which DCP checkpoints and the gather-free export
read as any other sharded tensor.

Gradients: FSDP2 averages every gradient over the ranks of its group: the dense ones over the data-parallel world
``W = dp_replicate x dp_shard x cp``, the experts' over ``W / ep`` (``efsdp x dp_replicate``). An expert's gradient
already sums the tokens of the ``ep`` ranks of its group (the all-to-all brought them), so expert parallel scales it
by ``1 / ep`` in its backward (:mod:`hf_fsdp2.parallel.expert_parallel`): both groups then hold the gradient of the
step's mean. (FSDP2's ``set_gradient_divide_factor`` would do it inside the reduce-scatter, but gloo has no
``PREMUL_SUM``, and its sum-then-divide path divides twice on a group of one rank, ``efsdp = 1``: measured, torch 2.13.)

Rank-0 loading (``fsdp_cpu_ram_efficient_loading``): Accelerate's own broadcast reads rank 0's full state dict, in
which the experts are rank 0's block only once split; the run therefore keeps rank 0's full tensors from before the
split (:func:`rank0_state`), lets Accelerate shard without loading, then broadcasts each tensor and keeps each rank's
shard (:func:`load_rank0_state`), as Accelerate does, per tensor.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from hf_fsdp2.config.plans import MeshPlan
from hf_fsdp2.parallel.experts import find_experts


@dataclass(frozen=True)
class ExpertMeshes:
    """Where the experts live.

    Attributes:
        ep: the ``ep`` mesh dimension (the ranks that exchange tokens and split the experts).
        experts: FSDP2's mesh info of the experts: ``efsdp`` (HSDP: ``dp_replicate x efsdp``).
    """

    ep: DeviceMesh
    experts: Any


def expert_meshes(mesh: MeshPlan, device_type: str) -> ExpertMeshes:
    """The experts' meshes over the world of ``mesh`` (collective: every rank builds every group). Ranks are laid out
    as in the run's mesh, ``ep`` innermost within ``dp_shard x cp``: rank ``r x S + f x ep + e`` (S = dp_shard x cp)
    is expert shard ``f`` of ep rank ``e`` in replica group ``r``."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo

    shape: tuple[int, ...] = (mesh.efsdp, mesh.ep)
    names: tuple[str, ...] = ("efsdp", "ep")
    if mesh.hybrid:
        shape, names = (mesh.dp_replicate, *shape), ("dp_replicate", *names)
    grid = init_device_mesh(device_type, shape, mesh_dim_names=names)
    info: Any
    if mesh.hybrid:
        info = HSDPMeshInfo(mesh=grid["dp_replicate", "efsdp"], shard_mesh_dim=1, replicate_mesh_dim=0)
    else:
        info = FSDPMeshInfo(mesh=grid["efsdp"], shard_mesh_dim=0)
    return ExpertMeshes(ep=grid["ep"], experts=info)


def _units(model: nn.Module, classes: tuple[str, ...]) -> Iterator[nn.Module]:
    """The FSDP2 units of ``classes`` that hold experts, bottom-up, as Accelerate picks them: an activation-checkpoint
    wrapper rather than the layer it wraps (the hooks stay outside the checkpointed, compiled code)."""
    inner = set()
    for module in model.modules():
        wrapped = getattr(module, "_checkpoint_wrapped_module", None)
        if wrapped is not None:
            inner.add(id(wrapped))
    for module in reversed(list(model.modules())):
        target = getattr(module, "_checkpoint_wrapped_module", module)
        if id(module) in inner or type(target).__name__ not in classes or isinstance(module, FSDPModule):
            continue
        if find_experts(target):
            yield module


def shard_expert_layers(
    model: nn.Module,
    classes: tuple[str, ...],
    meshes: ExpertMeshes,
    *,
    mesh: DeviceMesh | None,
    fsdp_kwargs: dict[str, Any],
    upcast: bool,
) -> int:
    """``fully_shard`` each unit of ``classes`` that holds experts, one unit each: the experts' tensors on
    ``meshes.experts``, every other parameter on ``mesh`` (None: the default mesh over every rank, as Accelerate's);
    Every rank calls it, before Accelerate shards the rest (it
    skips units already sharded). ``upcast``: trainable parameters to fp32 first (mixed precision: the fp32 masters
    Accelerate's prepare would make, which it cannot do once they are sharded). Returns the units sharded."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult

    experts = {id(p) for m in find_experts(model).values() for p in m.parameters(recurse=False)}
    placement = ShardPlacementResult(placement=Shard(0), mesh_info=meshes.experts)

    def place(param: nn.Parameter) -> Any:
        return placement if id(param) in experts else None

    units = list(_units(model, classes))
    for unit in units:
        if upcast:
            for param in unit.parameters():
                if param.requires_grad and param.dtype != torch.float32:
                    param.data = param.data.to(torch.float32)
        fully_shard(unit, mesh=mesh, shard_placement_fn=place, **fsdp_kwargs)
    return len(units)


def rank0_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Rank 0's whole tensors by state-dict name, taken before expert parallel splits the experts (references, no
    copy): what :func:`load_rank0_state` broadcasts."""
    return dict(model.state_dict())


def load_rank0_state(
    model: nn.Module, state: dict[str, torch.Tensor] | None, device: torch.device, *, offload: bool = False
) -> int:
    """Fill every rank's shards from rank 0's whole tensors ``state`` (None on the other ranks, whose sharded model
    is on the meta device): each tensor broadcast from rank 0 in the dtype of its shard, each rank keeping its part
    (collective: every rank, in the state dict's order); ``offload``: the shards kept in host memory (FSDP2's CPU
    offload). Returns the tensors loaded."""
    target = model.state_dict()
    loaded: dict[str, torch.Tensor] = {}
    for name, value in target.items():
        if state is not None:
            full = state[name].detach().to(device=device, dtype=value.dtype).contiguous()
        else:
            full = torch.empty(value.shape, dtype=value.dtype, device=device)
        dist.broadcast(full, src=0)
        if isinstance(value, DTensor):
            part = distribute_tensor(full, value.device_mesh, value.placements, src_data_rank=None)
            loaded[name] = part.to("cpu") if offload else part
        else:
            loaded[name] = full
    model.load_state_dict(loaded, assign=True)
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()
    return len(loaded)
