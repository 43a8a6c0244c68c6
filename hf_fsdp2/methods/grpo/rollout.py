"""GRPO's rollout: completions sampled from the current policy while it is sharded with FSDP2.

A plain ``generate`` on an FSDP2 model would all-gather every decoder layer's parameters at every new token (each
forward unshards and reshards them), and ranks whose completions end at different lengths would run different
numbers of forwards, so of collectives: a hang. :func:`gathered` instead all-gathers every unit once for the whole
rollout phase and keeps it gathered (no collective runs during generation, whatever each rank generates), then
reshards and restores each unit's ``reshard_after_forward``. Rank symmetry holds by construction: every rank
enters and leaves the phase once, and generates only for its own prompts.

Where one full copy of the model does not fit beside its shards, ``gather: layer`` (``rollout_gather: layer``)
keeps FSDP2's per-layer gathers and frees each layer after its forward, at the cost of one all-gather per layer per
token; every rank then decodes until every rank is done (transformers' ``synced_gpus``: one flag all-reduce per
token), so the collectives still match.

Generation goes through the small :class:`Generator` interface, so a serving engine can take its place later;
today's backend is transformers' ``generate`` with its KV cache (:class:`TransformersGenerator`). Sampling draws
from a generator seeded by (seed, step, rank): a resumed run samples exactly what the uninterrupted one did.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class Generator(Protocol):
    """What the recipe needs of a generation backend."""

    def generate(
        self, prompts: Sequence[Sequence[int]], *, seed: int, greedy: bool = False
    ) -> list[list[int]]:
        """One completion per prompt (token ids, ending with an end-of-sequence token unless cut at the length)."""
        ...


@contextmanager
def gathered(model: torch.nn.Module) -> Iterator[None]:
    """Every FSDP2 unit of ``model`` all-gathered once and kept gathered inside the block, then resharded.

    Every rank must enter it (one all-gather per unit); inside, forwards run no collective. A model without FSDP2
    units (one process, no sharding) passes through unchanged.
    """
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    saved = [(unit, reshards_after_forward(unit)) for unit in units]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)  # no reshard after each forward
    try:
        for unit in units:
            unit.unshard()
        yield
    finally:
        for unit in units:
            unit.reshard()
        for unit, value in saved:
            unit.set_reshard_after_forward(value, recurse=False)


def reshards_after_forward(unit: torch.nn.Module) -> bool:
    """Whether the FSDP2 unit ``unit`` frees its gathered parameters after each forward.

    FSDP2 sets this publicly (``FSDPModule.set_reshard_after_forward``) but has no getter, so this reads it
    from the unit's parameter groups (read only: the write goes through the setter). A unit resharding to a
    smaller group (``reshard_after_forward=<int>``, which hf_fsdp2 never asks for) has no boolean to restore:
    refused. tests/unit/test_upstream_patches.py fails if torch renames what this reads.

    Raises:
        RuntimeError: the unit reshards to a group of another size, or this torch's FSDP2 state lacks the
            attributes read here.
    """
    state = unit._get_fsdp_state()  # type: ignore[operator]
    values = []
    for group in getattr(state, "_fsdp_param_groups", None) or ():
        if not hasattr(group, "post_forward_mesh_info") or not hasattr(group, "mesh_info"):
            raise RuntimeError(
                f"torch {torch.__version__}'s FSDP2 parameter group has no post_forward_mesh_info / mesh_info: "
                "the rollout cannot read which units reshard after forward; use the torch docs/compatibility.md "
                "lists as tested (2.11-2.13) or set grpo.rollout_gather: layer"
            )
        info = group.post_forward_mesh_info
        if info is not None and info is not group.mesh_info:
            raise RuntimeError(
                f"FSDP2 unit {type(unit).__name__} reshards after forward to a group of another size "
                "(fully_shard(reshard_after_forward=<int>)); the rollout can restore only true or false: "
                "shard it with a boolean or set grpo.rollout_gather: layer"
            )
        values.append(info is not None)
    return any(values)  # one group per fully_shard call: all of a unit's groups agree


@dataclass(frozen=True)
class SamplingSettings:
    """How completions are sampled (TRL's ``GRPOConfig`` names)."""

    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    do_sample: bool = True
    gather: str = (
        "full"  # "full": every unit gathered once per rollout; "layer": FSDP2's per-layer gathers, synced
    )


def left_padded(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as one left-padded batch (ids, attention mask): generation continues every row at its end."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if len(prompt):
            ids[row, -len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
            mask[row, -len(prompt) :] = 1
    return ids, mask


def cut_at_eos(rows: torch.Tensor, eos_ids: Sequence[int]) -> list[list[int]]:
    """Each generated row up to and including its first end-of-sequence token (all of it when there is none)."""
    out = []
    for row in rows.tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        out.append(row[:end])
    return out


class TransformersGenerator:
    """transformers' ``generate`` with the KV cache, on the FSDP2-sharded policy gathered once per rollout."""

    def __init__(
        self, model: torch.nn.Module, *, pad_id: int, eos_ids: Sequence[int], settings: SamplingSettings
    ):
        self.model, self.pad_id, self.eos_ids, self.settings = model, pad_id, list(eos_ids), settings

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(
        self, prompts: Sequence[Sequence[int]], *, seed: int, greedy: bool = False
    ) -> list[list[int]]:
        """``greedy``: the most likely token at each position (evaluation), whatever the sampling settings."""
        s = self.settings
        ids, mask = left_padded(prompts, self.pad_id)
        device = next(self.model.parameters()).device
        kwargs: dict[str, Any] = dict(
            max_new_tokens=s.max_completion_length, do_sample=s.do_sample and not greedy, pad_token_id=self.pad_id,
            eos_token_id=self.eos_ids, use_cache=True,
        )  # fmt: skip
        if getattr(getattr(self.model, "config", None), "output_router_logits", False):
            # A MoE's load-balancing loss is a training term; computed while decoding with a KV cache, transformers
            # mismatches the router logits with the attention mask.
            kwargs["output_router_logits"] = False
        if kwargs["do_sample"]:
            kwargs.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
        else:  # greedy: no sampling settings (transformers warns about unused ones)
            kwargs.update(temperature=None, top_p=None, top_k=None)
        import torch.distributed as dist

        # "full": nothing collective inside (each rank stops at its own length); "layer": each forward all-gathers
        # its layer as in training, so every rank keeps decoding (dummy steps) until all are done: transformers'
        # synced_gpus, one flag all-reduce per token.
        layered = s.gather == "layer"
        kwargs["synced_gpus"] = layered and dist.is_initialized() and dist.get_world_size() > 1
        was_training = self.model.training
        self.model.eval()
        try:
            with (
                contextlib.nullcontext() if layered else gathered(self.model),
                torch.no_grad(),
                torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]),
            ):
                torch.manual_seed(seed)
                out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)  # type: ignore[operator]
        finally:
            self.model.train(was_training)
        return cut_at_eos(out[:, ids.shape[1] :].cpu(), self.eos_ids)


def rollout_seed(seed: int, step: int, rank: int) -> int:
    """The sampling seed of one rank's rollout at ``step``: a resumed run draws what the uninterrupted one drew."""
    return (seed * 1_000_003 + step * 9_973 + rank) % (2**31 - 1)
