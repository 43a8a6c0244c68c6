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
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class Generator(Protocol):
    """What the recipe needs of a generation backend."""

    eos_ids: list[int]  # the ids that end a completion (a completion without one at its end was clipped)

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


@dataclass(frozen=True, kw_only=True)
class SamplingSettings:
    """How completions are sampled (TRL's ``GRPOConfig`` names and defaults)."""

    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    do_sample: bool = True
    gather: str = (
        "full"  # "full": every unit gathered once per rollout; "layer": FSDP2's per-layer gathers, synced
    )
    repetition_penalty: float = 1.0
    min_p: float | None = None
    generation_kwargs: Mapping[str, Any] = field(
        default_factory=dict
    )  # applied last: GenerationConfig fields here, SamplingParams fields with vLLM (vllm/client.py, vllm/server.py)


def stop_token_ids(tokenizer_eos: int | None, model_eos: int | Sequence[int] | None) -> list[int]:
    """The ids that end a completion, as TRL 1.16's ``GRPOTrainer``: every id of the model's
    ``generation_config.eos_token_id`` (an end-of-turn token: Gemma's ``<end_of_turn>``, Phi-3's ``<|end|>``,
    Qwen2.5's ``<|im_end|>``), with the tokenizer's end-of-sequence id first when it is not among them."""
    ids = (
        []
        if model_eos is None
        else [int(model_eos)]
        if isinstance(model_eos, int)
        else [int(i) for i in model_eos]
    )
    if tokenizer_eos is not None and int(tokenizer_eos) not in ids:
        ids = [int(tokenizer_eos), *ids]
    return ids


def is_clipped(completion: Sequence[int], eos_ids: Sequence[int]) -> bool:
    """Whether a completion stopped at ``max_completion_length`` rather than at an end token (TRL's
    ``completions/clipped_ratio`` counts these)."""
    return not completion or completion[-1] not in eos_ids


def generation_config(
    settings: SamplingSettings,
    *,
    eos_ids: Sequence[int],
    pad_id: int,
    bos_id: int | None,
    greedy: bool = False,
) -> Any:
    """The ``GenerationConfig`` that samples, built from the settings alone (TRL's fields and defaults, then
    ``generation_kwargs``): :func:`plain_generation_config` keeps the model's ``generation_config`` out of it."""
    from transformers import GenerationConfig

    s = settings
    kwargs: dict[str, Any] = dict(
        max_new_tokens=s.max_completion_length,
        do_sample=s.do_sample and not greedy,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=list(eos_ids),
        repetition_penalty=s.repetition_penalty,
        use_cache=True,
    )
    if kwargs["do_sample"]:
        kwargs.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p)
    kwargs.update(s.generation_kwargs)
    return GenerationConfig(**kwargs)


@contextmanager
def plain_generation_config(model: torch.nn.Module, config: Any) -> Iterator[None]:
    """The model's ``generation_config`` replaced by ``config`` inside the block, then restored.

    transformers' ``generate`` fills every field a passed config leaves unset (None) from the model's own
    ``generation_config`` (Qwen2.5-Instruct's ``repetition_penalty: 1.05``, a ``min_p``, ``suppress_tokens``...):
    the rollout would sample a distribution other than the one the loss scores. Inside the block the model's
    config is the one that samples, so nothing else comes in (PEFT's ``generate`` copies the wrapper's onto the base
    model: both are replaced and restored).
    """
    holders = [model]
    base = getattr(model, "get_base_model", None)
    if callable(base) and base() is not model:
        holders.append(base())
    saved = [(m, m.__dict__.get("generation_config")) for m in holders]
    try:
        for m in holders:
            m.__dict__["generation_config"] = config
        yield
    finally:
        for m, value in saved:
            if value is None:
                m.__dict__.pop("generation_config", None)
            else:
                m.__dict__["generation_config"] = value


def describe_sampling(config: Any, model_config: Any) -> str:
    """The start-up line naming the config that samples and what of the model's ``generation_config`` it leaves
    out."""
    from transformers import GenerationConfig

    fields = (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "max_new_tokens",
        "eos_token_id",
    )
    used = ", ".join(f"{k} {getattr(config, k, None)}" for k in fields)
    extra = {
        k: v
        for k, v in config.to_diff_dict().items()
        if k not in fields
        and k not in ("do_sample", "pad_token_id", "bos_token_id", "use_cache", "transformers_version")
    }
    if extra:
        used += ", " + ", ".join(f"{k} {v}" for k, v in sorted(extra.items()))
    ignored = {}
    if model_config is not None:  # what transformers would have taken from it (falsy = its default: off)
        default = GenerationConfig().to_dict()
        skip = ("eos_token_id", "pad_token_id", "bos_token_id", "transformers_version", "_from_model_config")
        ignored = {
            k: v
            for k, v in model_config.to_dict().items()
            if k not in skip
            and (v or default.get(k))
            and v != default.get(k)
            and v != getattr(config, k, None)
        }
    note = (
        f"; not from the model's generation_config: {', '.join(f'{k} {v}' for k, v in sorted(ignored.items()))}"
        if ignored
        else ""
    )
    return f"rollout samples with: {used}{note}"


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
    """Each generated row up to and including its first end token (any of ``eos_ids``: :func:`stop_token_ids`; all
    of it when there is none)."""
    out = []
    for row in rows.tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        out.append(row[:end])
    return out


class TransformersGenerator:
    """transformers' ``generate`` with the KV cache, on the FSDP2-sharded policy gathered once per rollout, with
    the generation config of :func:`generation_config` (nothing taken from the model's ``generation_config``)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        pad_id: int,
        eos_ids: Sequence[int],
        settings: SamplingSettings,
        bos_id: int | None = None,
    ):
        self.model, self.pad_id, self.settings = model, pad_id, settings
        ids = dict(eos_ids=eos_ids, pad_id=pad_id, bos_id=bos_id)
        self.sampling = generation_config(settings, **ids)  # type: ignore[arg-type]
        self.greedy = generation_config(settings, greedy=True, **ids)  # type: ignore[arg-type]
        eos = self.sampling.eos_token_id  # generation_kwargs may set its own
        self.eos_ids = [int(eos)] if isinstance(eos, int) else [int(i) for i in eos or ()]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def describe(self) -> str:
        """The start-up line: the config that samples, and what of the model's own it leaves out."""
        return describe_sampling(self.sampling, getattr(self.model, "generation_config", None))

    def generate(
        self, prompts: Sequence[Sequence[int]], *, seed: int, greedy: bool = False
    ) -> list[list[int]]:
        """``greedy``: the most likely token at each position (evaluation), whatever the sampling settings."""
        s = self.settings
        ids, mask = left_padded(prompts, self.pad_id)
        device = next(self.model.parameters()).device
        config = self.greedy if greedy else self.sampling
        kwargs: dict[str, Any] = {}
        if getattr(getattr(self.model, "config", None), "output_router_logits", False):
            # A MoE's load-balancing loss is a training term; computed while decoding with a KV cache, transformers
            # mismatches the router logits with the attention mask.
            kwargs["output_router_logits"] = False
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
                plain_generation_config(self.model, config),
                torch.no_grad(),
                torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]),
            ):
                torch.manual_seed(seed)
                out = self.model.generate(  # type: ignore[operator]
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    generation_config=config,
                    **kwargs,
                )
        finally:
            self.model.train(was_training)
        return cut_at_eos(out[:, ids.shape[1] :].cpu(), self.eos_ids)


def rollout_seed(seed: int, step: int, rank: int) -> int:
    """The sampling seed of one rank's rollout at ``step``: a resumed run draws what the uninterrupted one drew."""
    return (seed * 1_000_003 + step * 9_973 + rank) % (2**31 - 1)
