"""Whole parameters out of a sharded model, one FSDP unit at a time, in the receiver's dtype: what the vLLM weight
syncs hand to an engine (the server's, over the trainer-server group, or an in-process one).

A unit is one ``fully_shard`` call's parameters (a decoder layer; the root's embeddings, final norm and head), the
grain FSDP2 itself gathers at. Each rank casts its shards to the engine's dtype *before* the gather and packs them
into one buffer, so a unit costs one ``all_gather_into_tensor`` over its shard group, of ``dtype``'s bytes: for
Llama-3-8B in bf16, 33 all-gathers and 16 GB per rank per update, where a ``full_tensor`` per parameter in fp32 is 291
and 32 GB. Every rank calls :func:`gathered_units` in the same order with the same units (the same calls whatever it
keeps), so the collectives match by construction; at most one unit's full tensors are alive on a rank at once.

Counts (:class:`GatherCounts`), per update and rank, for units ``u`` over a shard group of ``W`` ranks, each
parameter ``p`` of ``rows_p`` rows of ``row_p`` elements: ``collectives`` = the units holding a sharded parameter (a
unit FSDP2 holds unsharded at that moment, as the root after a forward without gradient, is whole already: no
gather);
``bytes`` = ``sum_u W x sum_p ceil(rows_p / W) x row_p x itemsize(dtype)`` (each rank's shard padded to the largest,
as FSDP2 pads), the parameters' ``numel x itemsize`` plus at most ``W - 1`` padding rows each; ``host_bytes`` = the
shard bytes copied from host memory to the gather's device (CPU-offloaded shards under NCCL; 0 otherwise).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")

Unit = list[tuple[str, torch.nn.Parameter]]


def checkpoint_name(name: str) -> str:
    """A parameter's checkpoint name: without the wrappers' parts (activation checkpointing, compile, FSDP1)."""
    for part in _WRAPPERS:
        name = name.replace(part, "")
    return name


@dataclass(kw_only=True)
class GatherCounts:
    """What the gathers of an update moved on this rank (the module docstring's formula)."""

    collectives: int = 0
    bytes: int = 0  # received by the all-gathers (their outputs), this rank
    host_bytes: int = 0  # host -> device copies of shards before a gather
    units: int = 0
    tensors: int = 0


@dataclass
class GatheredUnit:
    """One unit's full tensors, back to back in ``flat`` (the engine's dtype, on the gather's device), each a view of
    it under its checkpoint name; ``flat`` is None and ``tensors`` empty where the caller kept nothing."""

    flat: torch.Tensor | None
    tensors: list[tuple[str, torch.Tensor]]
    shapes: list[tuple[str, tuple[int, ...]]]  # every tensor's name and shape, kept or not


def sync_units(model: torch.nn.Module) -> list[Unit]:
    """The model's parameters by unit, in ``named_parameters`` order (tied ones once), the same on every rank: each
    FSDP2 module's own parameters (those of no FSDP2 module inside it); a model without FSDP2 (one process): one
    unit per decoder layer (``...layers.<i>.``) and one for the rest."""
    from torch.distributed.fsdp import FSDPModule

    fsdp = {name for name, m in model.named_modules() if isinstance(m, FSDPModule)}
    units: dict[str, Unit] = {}
    for name, param in model.named_parameters():
        if fsdp:
            parts = name.split(".")
            key = next(
                (".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1) if ".".join(parts[:i]) in fsdp),
                "",
            )
        else:
            parts = checkpoint_name(name).split(".")
            at = parts.index("layers") + 1 if "layers" in parts[:-1] else 0
            key = ".".join(parts[: at + 1]) if at else ""
        units.setdefault(key, []).append((checkpoint_name(name), param))
    return list(units.values())


def _shard_group(param: torch.Tensor) -> tuple[object | None, torch.Tensor]:
    """The process group a parameter is sharded over (None: it is whole on every rank) and this rank's rows.

    Raises:
        RuntimeError: a placement other than FSDP2's (one ``Shard(0)``, the other mesh dimensions ``Replicate``).
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(param, DTensor):
        return None, param.detach()
    local = param.to_local().detach()
    sharded = [i for i, p in enumerate(param.placements) if not isinstance(p, Replicate)]
    if not sharded:
        return None, local
    if len(sharded) > 1 or param.placements[sharded[0]] != Shard(0):
        raise RuntimeError(
            f"a parameter placed {param.placements} on mesh {param.device_mesh}: the weight sync gathers FSDP2's "
            "Shard(0) over one mesh dimension (tensor or context parallel shards are not synced to vLLM)"
        )
    return param.device_mesh.get_group(sharded[0]), local


def _device_of(group: object | None, fallback: torch.device) -> torch.device:
    """Where a unit's buffers live: NCCL's device for an NCCL group (shards offloaded to host memory are copied
    there), else the shards' own."""
    import torch.distributed as dist

    if group is not None and dist.get_backend(group) == "nccl":  # type: ignore[arg-type]
        return torch.device("cuda", torch.cuda.current_device())
    return fallback


def gather_unit(unit: Unit, dtype: torch.dtype, keep: bool, counts: GatherCounts) -> GatheredUnit:
    """``unit``'s full tensors in ``dtype`` (collective over the unit's shard group: every rank calls it with the same
    unit); ``keep`` False: the gather runs, nothing is unpacked (a rank that only takes part)."""
    import torch.distributed as dist

    placed = [(name, param, *_shard_group(param)) for name, param in unit]
    groups = {id(g): g for _, _, g, _ in placed if g is not None}
    if len(groups) > 1:
        raise RuntimeError(
            f"one FSDP unit's parameters ({', '.join(n for n, *_ in placed[:3])}...) are sharded over "
            f"{len(groups)} process groups: the weight sync gathers a unit in one collective"
        )
    group = next(iter(groups.values()), None)
    sizes = [p.numel() for _, p, _, _ in placed]
    device = _device_of(group, placed[0][3].device if placed else torch.device("cpu"))
    flat = torch.empty(sum(sizes), dtype=dtype, device=device) if keep else None
    gathered: dict[int, tuple[torch.Tensor, int, int, int]] = {}
    if group is not None:
        world = dist.get_world_size(group)  # type: ignore[arg-type]
        layout, total = [], 0
        for i, (_, param, g, _) in enumerate(placed):
            if g is not None:
                rows = param.shape[0]
                row = param.numel() // max(rows, 1)
                chunk = math.ceil(rows / world)
                layout.append((i, total, chunk, row))
                total += chunk * row
        send = torch.empty(total, dtype=dtype, device=device)
        for i, offset, _, _ in layout:
            local = placed[i][3]
            if local.device != device:
                counts.host_bytes += local.numel() * local.element_size()
            send[offset : offset + local.numel()].copy_(local.reshape(-1))  # the cast, before the gather
        out = torch.empty(world * total, dtype=dtype, device=device)
        # Every rank of the group; torch 2.13 renamed all_gather_into_tensor (deprecated there) all_gather_single.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, send, group=group)
        counts.collectives += 1
        counts.bytes += out.numel() * out.element_size()
        del send
        by_rank = out.view(world, total)
        for i, offset, chunk, row in layout:
            gathered[i] = (by_rank, offset, chunk, row)
    tensors, shapes, at = [], [], 0
    for i, (name, param, _, local) in enumerate(placed):
        shape, size = tuple(param.shape), sizes[i]
        shapes.append((name, shape))
        if flat is not None:
            dst = flat[at : at + size]
            if (
                i in gathered
            ):  # rank r's padded rows at [r, offset:offset + chunk x row]: the first rows whole
                by_rank, offset, chunk, row = gathered[i]
                whole, rest = divmod(shape[0], chunk)
                dst[: whole * chunk * row].view(whole, chunk * row).copy_(
                    by_rank[:whole, offset : offset + chunk * row]
                )
                if rest:
                    dst[whole * chunk * row :].copy_(by_rank[whole, offset : offset + rest * row])
            else:
                dst.copy_(local.reshape(-1))
            tensors.append((name, dst.view(shape)))
        at += size
    counts.units += 1
    counts.tensors += len(placed)
    return GatheredUnit(flat=flat, tensors=tensors, shapes=shapes)


def gathered_units(
    units: list[Unit], dtype: torch.dtype, keep: bool, counts: GatherCounts
) -> Iterator[GatheredUnit]:
    """Each unit's full tensors (:func:`gather_unit`), unit after unit: every rank iterates the whole of it."""
    for unit in units:
        yield gather_unit(unit, dtype, keep, counts)
