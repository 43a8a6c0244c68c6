"""The vision tower's FSDP2 grain: the whole tower as one unit, or one unit per block plus one for the rest of the
tower (its patch embedding, norms and a projector inside it), chosen from the parameter sizes, every rank alike.

Measured on 2 gloo ranks (tests/distributed/test_vlm_2rank.py, figures in docs/vlm.md): both grains gather every
tower parameter once per forward, in 1 collective as one unit or ``blocks + 1`` per block. In backward FSDP2
prefetches the unit that ran just before a unit whose backward runs, whether or not anything in it trains: the
first decoder layer (or a projector unit that trains) prefetches the whole tower as one unit, all-gathered again
even when frozen, but only the rest per block; the blocks are gathered again only where they train. What is
unsharded at once:

- one unit: the whole tower ``T`` while it runs, and in backward ``T`` beside the first decoder layer ``L``;
- per block: the rest ``r`` and one block ``b`` in forward, two blocks in backward where they train (the one
  computing and the one prefetched): ``r + 2b``, and ``r`` beside the first decoder layer.

The language model needs two decoder layers ``2L`` unsharded at once anyway (one computing, the next prefetched).
:func:`choose_grain` shards per block where that lowers the peak (a tower larger than a decoder layer) or the bytes
(a frozen tower that the backward prefetches); one unit otherwise, which saves ``blocks`` collectives per pass
(latency, small NCCL messages) for the same bytes and peak.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch

from hf_fsdp2.composite import CompositeSpec
from hf_fsdp2.vision.tower import unwrap_model

logger = logging.getLogger("hf_fsdp2")

Grain = Literal["tower", "blocks"]


@dataclass(frozen=True, kw_only=True)
class TowerSizes:
    """What the grains gather, in bytes of the parameters as stored (the same ratio in any gather dtype).

    Attributes:
        tower: the tower's unit as one unit (a projector inside the tower included).
        block: the largest block.
        blocks: how many blocks.
        rest: the tower's parameters outside its blocks (its own unit per block).
        layer: the largest decoder layer of the language model.
        blocks_train: a block has a trainable parameter (its unit is gathered again in backward).
        rest_trains: a parameter of the rest trains (Qwen's merger: the rest, or the one unit, is gathered in
            backward).
        prefetched: the unit after the tower in forward runs a backward (the first decoder layer, or a projector
            unit of its own that trains), so FSDP2 gathers the tower's (or the rest's) unit again in backward.
    """

    tower: int
    block: int
    blocks: int
    rest: int
    layer: int
    blocks_train: bool
    rest_trains: bool
    prefetched: bool


def _bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def tower_blocks(tower: torch.nn.Module) -> torch.nn.ModuleList:
    """The tower's blocks: its longest ``ModuleList`` (Qwen3-VL's DeepStack mergers are a second, shorter one: three
    beside 27 blocks), the one with more parameters where two are as long.

    Raises:
        ValueError: the tower has no list of modules.
    """
    lists = [m for m in tower.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(
            f"{type(tower).__name__} has no list of blocks to shard it by (another transformers layout than the "
            "one tested); install the transformers docs/compatibility.md lists"
        )
    return max(lists, key=lambda m: (len(m), _bytes(m)))


def tower_sizes(model: torch.nn.Module, spec: CompositeSpec, layer_cls: tuple[str, ...]) -> TowerSizes:
    """The sizes of ``model``'s tower (its first module of ``spec.tower``) and largest decoder layer; the parameters'
    shapes, dtypes and ``requires_grad`` only (a model on the meta device gives the same answer)."""
    tower = model.get_submodule(spec.tower[0])
    blocks = tower_blocks(tower)
    in_blocks = {id(p) for p in blocks.parameters()}
    rest = [p for p in tower.parameters() if id(p) not in in_blocks]
    layers = [m for m in model.modules() if type(m).__name__ in layer_cls]
    return TowerSizes(
        tower=_bytes(tower),
        block=max(_bytes(b) for b in blocks),
        blocks=len(blocks),
        rest=sum(p.numel() * p.element_size() for p in rest),
        layer=max((_bytes(m) for m in layers), default=0),
        blocks_train=any(p.requires_grad for p in blocks.parameters()),
        rest_trains=any(p.requires_grad for p in rest),
        prefetched=spec.projector_unit is None
        or any(p.requires_grad for path in spec.projector for p in model.get_submodule(path).parameters()),
    )


def tower_peak(sizes: TowerSizes, grain: Grain) -> int:
    """The most bytes of the tower's own units unsharded at once: the whole tower as one unit; per block the rest
    and one block in forward, and two blocks in backward where they train (the one computing and the one FSDP2
    prefetches)."""
    s = sizes
    if grain == "tower":
        return s.tower
    return s.rest + (2 if s.blocks_train else 1) * s.block


def _backward(sizes: TowerSizes) -> bool:
    """The tower's unit (one unit) or its rest (per block) is gathered in backward."""
    return sizes.blocks_train or sizes.rest_trains or sizes.prefetched


def tower_gathers(sizes: TowerSizes, grain: Grain) -> int:
    """All-gathers of the tower's units per forward and backward of a micro-batch: one unit once in forward and once
    in backward (:func:`_backward`); per block ``blocks + 1`` in forward, and in backward ``blocks + 1`` where the
    blocks train, 2 where only the rest trains (the rest, and the last block its backward prefetches), 1 where the
    rest is only prefetched."""
    s = sizes
    if grain == "tower":
        return 1 + int(_backward(s))
    backward = s.blocks + 1 if s.blocks_train else 2 if s.rest_trains else int(s.prefetched)
    return s.blocks + 1 + backward


def tower_gather_bytes(sizes: TowerSizes, grain: Grain) -> int:
    """The bytes those all-gathers bring per micro-batch (parameters as stored, padding left out)."""
    s = sizes
    if grain == "tower":
        return (1 + int(_backward(s))) * s.tower
    forward = s.rest + s.blocks * s.block
    backward = (
        forward if s.blocks_train else s.rest + s.block if s.rest_trains else s.rest * int(s.prefetched)
    )
    return forward + backward


def peak_unsharded(sizes: TowerSizes, grain: Grain) -> int:
    """The most parameter bytes unsharded at once around the tower and the decoder layers (the units kept gathered
    through the step, the root's and the head's, left out: the same under both grains): two decoder layers (one
    computing, the next prefetched), the tower's own peak (:func:`tower_peak`), and in backward a decoder layer
    beside what is prefetched of the tower (the whole tower as one unit, the rest per block)."""
    s = sizes
    beside = s.layer + (s.tower if grain == "tower" else s.rest) if _backward(s) else 0
    return max(2 * s.layer, tower_peak(sizes, grain), beside)


def choose_grain(sizes: TowerSizes) -> Grain:
    """Per block where that lowers the peak of unsharded parameters or the bytes all-gathered; the whole tower as
    one unit otherwise (fewer collectives for the same bytes and peak)."""
    lower_peak = peak_unsharded(sizes, "blocks") < peak_unsharded(sizes, "tower")
    fewer_bytes = tower_gather_bytes(sizes, "blocks") < tower_gather_bytes(sizes, "tower")
    return "blocks" if lower_peak or fewer_bytes else "tower"


def block_unit(model: torch.nn.Module, spec: CompositeSpec, layer_cls: tuple[str, ...]) -> str | None:
    """The class of the tower's blocks where :func:`choose_grain` shards it per block (each block a unit, the tower's
    own unit the rest), else None: the tower one unit, or a tower the composite table already shards per block
    (LLaVA's: its class cannot be a unit). Decided from shapes and ``requires_grad`` (set by the freezing before),
    the same on every rank; logged."""
    tower = unwrap_model(model).get_submodule(spec.tower[0])
    if type(tower).__name__ != spec.tower_unit:
        return None
    sizes = tower_sizes(unwrap_model(model), spec, layer_cls)
    grain = choose_grain(sizes)
    one, per_block = peak_unsharded(sizes, "tower"), peak_unsharded(sizes, "blocks")
    logger.info(
        "vision tower %s: %s (peak of unsharded parameters around it %.1f MiB as one unit, %.1f MiB per block; "
        "all-gathered per micro-batch with images %.1f MiB as one unit, %.1f MiB per block; %d blocks of %.1f MiB "
        "beside decoder layers of %.1f MiB)",
        type(tower).__name__,
        "one FSDP2 unit per block" if grain == "blocks" else "one FSDP2 unit",
        one / 2**20,
        per_block / 2**20,
        tower_gather_bytes(sizes, "tower") / 2**20,
        tower_gather_bytes(sizes, "blocks") / 2**20,
        sizes.blocks,
        sizes.block / 2**20,
        sizes.layer / 2**20,
    )
    return type(tower_blocks(tower)[0]).__name__ if grain == "blocks" else None
