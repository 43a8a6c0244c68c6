"""Expert parallel: tokens move, experts stay (torchtitan's "dp2ep", run through transformers' experts interface).

Each MoE layer's routed experts are split over the ``ep`` ranks of a group (rank ``j`` holds experts
``j x E/ep .. (j + 1) x E/ep - 1``, a DTensor ``Shard(0)`` over the ``ep`` mesh dimension). The family's own MoE block
runs unchanged: its router picks each token's top-k experts on the rank that holds the token, and its call of the
experts module goes, through transformers' experts interface (``config._experts_implementation``), to
:func:`expert_parallel_forward`, registered as :data:`EXPERTS_IMPLEMENTATION`:

1. dispatch: the (token, choice) pairs sorted by expert (so by the rank that holds it), the counts per expert
   exchanged with one ``all_to_all_single`` (``E`` integers per rank), read on the host once (the split sizes of the
   next exchanges), then the token rows exchanged with uneven splits;
2. compute: the received rows regrouped by local expert and run through the implementation the model had before
   (``grouped_mm``: one grouped matmul over the rank's experts) on this rank's experts alone;
3. combine: the results sent back by the reverse exchange, restored to (token, choice) order, weighted by the
   router's top-k weights on the token's own rank and summed over the choices in a fixed order (no scatter-add:
   deterministic).

Both token exchanges are autograd functions whose backward is the reverse exchange, so gradients take the same
routes back. Shared experts and routers are not touched: they run on each rank's own tokens.

Experts that receive no tokens: the grouped matmul gives them a zero gradient (its groups are empty). A rank whose
experts receive no token at all still puts the (empty) received rows and its expert tensors in the graph through a
zero term: its backward runs both exchanges as every other rank of the group does (a rank that skipped the second
would leave the others waiting in it: seen as a hang before this term existed), and every expert tensor gets a zero
gradient, so FSDP2 reduce-scatters the same buffers on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from hf_fsdp2.parallel.experts import ExpertLoad, counts_load, expert_load, experts_count, find_experts

EXPERTS_IMPLEMENTATION = "hf_fsdp2_expert_parallel"
_SHARD = "_hf_fsdp2_expert_shard"  # the per-module state attribute


@dataclass(kw_only=True)
class ExpertShard:
    """One experts module's place in its ep group.

    Attributes:
        group: the ep process group (the ranks that exchange tokens).
        size: ranks in the group (``ep``).
        rank: this rank's index in the group: it holds experts ``rank x local .. (rank + 1) x local - 1``.
        num_experts: routed experts of the layer.
        local_forward: the experts implementation the model ran before (transformers' interface function, or the
            class's own forward for ``eager``), run on this rank's experts alone.
        load: the tokens routed to each expert, counted on this rank (read and reset by the log).
        implementation: the name of the experts implementation ``local_forward`` is (what a twin of the model built
            from its config is given back before it is split alike: the config now names expert parallel).
    """

    group: Any
    size: int
    rank: int
    num_experts: int
    local_forward: Callable[..., torch.Tensor]
    load: ExpertLoad
    implementation: str = "grouped_mm"

    @property
    def local(self) -> int:
        return self.num_experts // self.size


class _LocalExperts:
    """The experts module as this rank's experts alone: the local blocks of its fused tensors and their count, every
    other attribute (activation, gate, flags) read from the module itself."""

    def __init__(self, module: nn.Module, tensors: dict[str, torch.Tensor], count: int) -> None:
        self.__dict__.update(tensors)
        self._module = module
        self.num_experts = count

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


class _ScaleGrad(torch.autograd.Function):
    """The identity, whose backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class _Exchange(torch.autograd.Function):
    """``all_to_all_single`` of rows with uneven splits; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return exchange_rows(rows, send, recv, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return exchange_rows(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def exchange_rows(rows: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    """Rows ``send[i]`` to rank ``i`` of ``group``, ``recv[i]`` rows from it (collective over the ep group)."""
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    dist.all_to_all_single(
        out, rows.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group
    )
    return out


def _regroup(received: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each received row goes when the rows, laid out by source rank then local expert, are laid out by local
    expert then source rank; and the local expert of each regrouped row. ``received``: ``[ep, local]`` counts."""
    ep, local = received.shape
    counts = received.reshape(-1)
    starts = torch.cumsum(counts, 0) - counts  # of each (source, expert) block in the received rows
    by_expert = received.t().reshape(-1)  # block lengths in the regrouped order
    block_starts = starts.view(ep, local).t().reshape(-1)
    regrouped_starts = torch.cumsum(by_expert, 0) - by_expert
    offset = torch.arange(total, device=received.device) - torch.repeat_interleave(
        regrouped_starts, by_expert, output_size=total
    )
    index = torch.repeat_interleave(block_starts, by_expert, output_size=total) + offset
    experts = torch.arange(local, device=received.device).repeat_interleave(ep)
    return index, torch.repeat_interleave(experts, by_expert, output_size=total)


def _inverse(index: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(index)
    out[index] = torch.arange(index.numel(), device=index.device)
    return out


@torch.compiler.disable  # data-dependent splits and collectives: eager inside a compiled decoder layer
def expert_parallel_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts interface function of expert parallel (every rank of the ep group calls it for the same layer, in
    the same order: the layers run in order on every rank). ``hidden_states [T, hidden]`` are this rank's tokens,
    ``top_k_index`` / ``top_k_weights [T, k]`` the router's choices; returns ``[T, hidden]``."""
    shard: ExpertShard = getattr(self, _SHARD)
    tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, choice) pairs by expert: by destination rank
    per_expert = torch.bincount(flat, minlength=shard.num_experts)
    if counts_load():
        shard.load.add(per_expert)
    received = torch.empty_like(per_expert)
    # The counts each rank sends each expert of this rank (the ep group, equal splits of E/ep integers).
    dist.all_to_all_single(received, per_expert, group=shard.group)
    received = received.view(shard.size, shard.local)
    sizes = torch.cat(
        [per_expert.view(shard.size, shard.local).sum(1), received.sum(1)]
    ).tolist()  # one host read
    send, recv = sizes[: shard.size], sizes[shard.size :]
    rows = _Exchange.apply(hidden_states[order // k], send, recv, shard.group)
    total = sum(recv)
    # Each expert's gradient sums the tokens of the whole ep group, and FSDP2 averages it over W / ep ranks where it
    # averages every other gradient over W (hf_fsdp2.parallel.expert_shard): 1 / ep here makes it the step's mean.
    local = {
        name: _ScaleGrad.apply(p.to_local() if isinstance(p, DTensor) else p, 1.0 / shard.size)
        for name, p in self.named_parameters(recurse=False)
    }
    if total:
        index, experts = _regroup(received, total)
        ones = torch.ones((total, 1), dtype=top_k_weights.dtype, device=rows.device)
        view = _LocalExperts(self, local, shard.local)
        out = shard.local_forward(view, rows[index], experts[:, None], ones)[_inverse(index)]
    else:
        # No token for any expert of this rank. The received (empty) rows and the expert tensors still enter the graph
        # through a zero: the backward then runs both exchanges here as on the other ranks of the group (a rank that
        # skipped one would leave them waiting in it), and every expert tensor gets its zero gradient, so FSDP2
        # reduce-scatters the same gradients here as on the ranks whose experts had tokens.
        zero = rows.sum() * 0 + sum(p.sum() * 0 for p in local.values())
        out = rows.new_zeros((0, rows.size(-1))) + zero
    back = _Exchange.apply(out.to(hidden_states.dtype), recv, send, shard.group)
    pairs = back[_inverse(order)].view(tokens, k, -1)
    return (pairs * top_k_weights.unsqueeze(-1)).sum(dim=1).to(hidden_states.dtype)


def _register() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if EXPERTS_IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, expert_parallel_forward)


def _interface_function(module: nn.Module, name: str) -> Callable[..., torch.Tensor]:
    """The function transformers' experts interface runs for implementation ``name`` (the class's own forward for
    ``eager``)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    own = getattr(type(module).forward, "__wrapped__", None)
    if own is None:
        raise ValueError(f"{type(module).__name__}.forward is not wrapped by transformers' experts interface")
    return ALL_EXPERTS_FUNCTIONS.get_interface(name, own)  # type: ignore[no-any-return]


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> str:
    """Split every experts module of ``model`` over ``ep_mesh`` (each fused tensor a DTensor ``Shard(0)``: this rank
    keeps its block of experts, sliced from its own copy, no communication; a meta model stays on meta) and route
    its forward through :func:`expert_parallel_forward`. Every rank calls it, before FSDP2. Returns the line the run
    logs.

    Raises:
        ValueError: a model whose experts implementation is already expert parallel (applied twice).
    """
    _register()
    config = model.config  # type: ignore[union-attr]
    before = getattr(config, "_experts_implementation", None) or "grouped_mm"
    if before == EXPERTS_IMPLEMENTATION:
        raise ValueError(f"{type(model).__name__} already runs expert parallel")
    group, size, rank = ep_mesh.get_group(), ep_mesh.size(), ep_mesh.get_local_rank()
    modules = find_experts(model)
    for module in modules.values():
        for name, param in list(module.named_parameters(recurse=False)):
            split = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(split, requires_grad=param.requires_grad))
        shard = ExpertShard(
            group=group,
            size=size,
            rank=rank,
            num_experts=experts_count(module),
            local_forward=_interface_function(module, before),
            load=expert_load(module),
            implementation=before,
        )
        setattr(module, _SHARD, shard)
    model.set_experts_implementation(EXPERTS_IMPLEMENTATION)  # type: ignore[operator]
    first = next(iter(modules.values()))
    total = experts_count(first)
    local = total // size
    return (
        f"expert parallel {size}: {len(modules)} experts modules ({type(first).__name__}), experts "
        f"{rank * local}..{(rank + 1) * local - 1} of {total} on this rank, computed by {before!r}; tokens "
        "exchanged with all_to_all_single"
    )


def expert_shards(model: nn.Module) -> dict[str, ExpertShard]:
    """The expert-parallel state of each experts module (empty without expert parallel)."""
    out = {}
    for name, module in find_experts(model).items():
        shard = getattr(module, _SHARD, None)
        if shard is not None:
            out[name] = shard
    return out
