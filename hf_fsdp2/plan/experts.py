"""Mixtures of experts in the plan: what the routed experts cost each rank at each ``ep_size``, from the meta model.

Without expert parallel FSDP2 shards each fused expert tensor over the ``n = dp_shard x cp`` ranks and all-gathers a
layer's whole expert stack for its forward and again for its backward (``reshard_after_forward``); with ``ep_size``
the experts are split over ``ep`` ranks (each holds ``E / ep`` whole experts, sharded over ``efsdp = n / ep``), only
that block is all-gathered, and the tokens move instead: each exchange sends every (token, choice) row to the rank
holding its expert. The figures, per rank and per MoE layer, for ``P`` parameters per expert, ``c`` bytes per
element in the compute dtype, ``g`` in the reduce dtype, ``T`` tokens per rank and micro-batch, top-``k``, hidden
size ``H``:

- gathered: ``(E / ep) x P x c`` (the all-gather output, padded to whole rows per rank as FSDP2 pads), of which a rank
  receives ``(efsdp - 1) / efsdp``; twice per micro-batch with ``reshard_after_forward`` (forward, backward), once
  without;
- reduce-scatter (the experts train): ``(E / ep) x P x g x (efsdp - 1) / efsdp`` sent per rank, once per micro-batch
  (``fsdp_sync_each_microbatch``) or per step;
- all-to-all: one exchange carries ``T x k x H x c`` bytes from each rank, ``(ep - 1) / ep`` of them to other ranks
  when routing is balanced; dispatch and combine in the forward, their reverses in the backward (4), and the forward's
  two again where activation checkpointing recomputes the layer (6); its buffers (the rows sent and received by one
  exchange) ``2 x T x k x H x c``, and up to ``ep`` times the received rows when every token of the group picks this
  rank's experts;
- the experts' sharded state (parameters, gradients, AdamW) is ``E / n`` experts per rank at every ``ep_size``: expert
  parallel changes what moves and what is gathered, not what is stored.

The proposal (:func:`propose_ep`): when the experts hold at least half of the parameters, the ``ep_size`` with the
fewest bytes sent per step, if it sends fewer than flat FSDP2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hf_fsdp2.dtypes import DTYPES
from hf_fsdp2.plan.meta_model import experts_modules
from hf_fsdp2.plan.settings import PlanSettings
from hf_fsdp2.plan.state import shard_rows

# The share of parameters above which the experts "dominate" and expert parallel is proposed.
DOMINANT_SHARE = 0.5


@dataclass(frozen=True, kw_only=True)
class ExpertShapes:
    """The routed experts of a model, read from its meta model.

    Attributes:
        classes: the experts classes.
        layers: decoder-layer indices that hold routed experts (one experts module each).
        num_experts: routed experts per layer (``E``).
        top_k: experts per token (``num_experts_per_tok``).
        hidden: hidden size (``H``).
        expert_numel: parameters of one expert (``P``: one expert's rows of every fused tensor, biases included).
        expert_params: parameters of every experts module together.
        total_params: parameters of the model.
        trained: whether the experts train (a full fine-tune) or stay frozen (LoRA: the adapter beside them is small).
        param_bytes: bytes per element of the experts' sharded tensors (fp32 masters when they train under mixed
            precision, the loaded dtype when frozen).
        implementation: the experts implementation transformers picked for the model (``grouped_mm`` by default).
    """

    classes: tuple[str, ...]
    layers: tuple[int, ...]
    num_experts: int
    top_k: int
    hidden: int
    expert_numel: int
    expert_params: int
    total_params: int
    trained: bool
    param_bytes: int
    implementation: str = "grouped_mm"

    @property
    def share(self) -> float:
        return self.expert_params / max(self.total_params, 1)


def expert_shapes(
    model: torch.nn.Module, model_config: Any, layer_cls: tuple[str, ...]
) -> ExpertShapes | None:
    """The routed experts of ``model`` (None for a dense model)."""
    from hf_fsdp2.parallel.activations import decoder_layers

    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    found: list[tuple[int, torch.nn.Module]] = []
    for index, (_, layer) in enumerate(decoder_layers(model, layer_cls)):
        found += [(index, m) for m in experts_modules(layer)]
    if not found:
        return None
    first = found[0][1]
    count: Any = first.num_experts
    experts = int(count)
    own = list(first.parameters(recurse=False))
    return ExpertShapes(
        classes=tuple(sorted({type(m).__name__ for _, m in found})),
        layers=tuple(i for i, _ in found),
        num_experts=experts,
        top_k=int(getattr(text, "num_experts_per_tok", 1) or 1),
        hidden=int(text.hidden_size),
        expert_numel=sum(p.numel() for p in own) // experts,
        expert_params=sum(p.numel() for _, m in found for p in m.parameters(recurse=False)),
        total_params=sum(p.numel() for p in model.parameters()),
        trained=any(p.requires_grad for p in own),
        param_bytes=own[0].element_size(),
        implementation=str(
            getattr(getattr(first, "config", None), "_experts_implementation", None) or "grouped_mm"
        ),
    )


def ep_sizes(shapes: ExpertShapes, shards: int) -> list[int]:
    """The ``ep_size`` values a run of ``shards = dp_shard x cp`` ranks can take: ``ep`` divides the shards and the
    experts, and the ``efsdp = shards / ep`` ranks shard each rank's ``E / ep`` experts by whole experts."""
    return [
        ep
        for ep in range(1, shards + 1)
        if shards % ep == 0
        and shapes.num_experts % ep == 0
        and (shapes.num_experts // ep) % (shards // ep) == 0
    ]


@dataclass(frozen=True, kw_only=True)
class ExpertTraffic:
    """What the experts cost one rank at one ``ep_size`` (bytes; per MoE layer unless named per step).

    Attributes:
        ep: the ``ep_size``; efsdp: ranks each rank's experts are sharded over.
        experts_per_rank: experts whose rows a rank computes (``E / ep``).
        sharded_bytes: the experts' sharded parameters, gradients and AdamW state on a rank, every layer.
        gathered: one layer's all-gather output (the unsharded experts of the rank's block).
        gather_received: bytes a rank receives per all-gather.
        reduce_sent: bytes a rank sends per reduce-scatter of the experts' gradients (0: frozen).
        exchange_sent: bytes a rank sends to other ranks per token exchange (0 without expert parallel).
        exchange_buffers: the rows sent and received by one exchange (balanced routing).
        exchange_buffers_worst: the same when every token of the ep group picks this rank's experts.
        step_sent: bytes a rank sends or receives for the experts per optimizer step (all-gathers received,
            reduce-scatters and exchanges sent), every MoE layer.
    """

    ep: int
    efsdp: int
    experts_per_rank: int
    sharded_bytes: int
    gathered: int
    gather_received: int
    reduce_sent: int
    exchange_sent: int
    exchange_buffers: int
    exchange_buffers_worst: int
    step_sent: int


def _exchanges(settings: PlanSettings, layer: int) -> int:
    """Token exchanges of one MoE layer per micro-batch: dispatch and combine forward, their reverses backward, and
    the forward's two again when activation checkpointing recomputes the layer (``full``, ``offload``, ``selective``:
    its policy keeps matmul outputs, not the exchanges; ``every_k``: layers 0, k, 2k, ...)."""
    mode = settings.ac.mode
    recomputed = mode in ("full", "offload", "selective") or (
        mode == "every_k" and layer % settings.ac.every_k == 0
    )
    return 6 if recomputed else 4


def expert_traffic(shapes: ExpertShapes, settings: PlanSettings, ep: int) -> ExpertTraffic:
    """The figures of :class:`ExpertTraffic` for ``ep`` (the module docstring's formulas)."""
    shards = settings.shard_size
    efsdp = shards // ep
    local = shapes.num_experts // ep
    compute = settings.compute_dtype.itemsize if settings.compute_dtype is not None else 4
    reduce = DTYPES[settings.reduce_dtype].itemsize
    padded = shard_rows(local, efsdp, 0)[1]  # FSDP2 pads every rank's rows to the first chunk's
    gathered = padded * efsdp * shapes.expert_numel * compute
    received = gathered * (efsdp - 1) // efsdp
    reduce_sent = padded * (efsdp - 1) * shapes.expert_numel * reduce if shapes.trained else 0
    tokens = settings.micro_batch * settings.seq_len // settings.cp
    rows = tokens * shapes.top_k * shapes.hidden * compute
    exchange = rows * (ep - 1) // ep if ep > 1 else 0
    state = 1 + (3 if shapes.trained else 0)  # parameters; + gradients and AdamW's two moments
    micro = settings.gradient_accumulation_steps
    gathers = (2 if settings.reshard_after_forward else 1) * micro
    reduces = (micro if settings.sync_each_microbatch else 1) if shapes.trained else 0
    step = sum(
        gathers * received + reduces * reduce_sent + micro * _exchanges(settings, layer) * exchange
        for layer in shapes.layers
    )
    return ExpertTraffic(
        ep=ep,
        efsdp=efsdp,
        experts_per_rank=local,
        sharded_bytes=len(shapes.layers) * padded * shapes.expert_numel * shapes.param_bytes * state,
        gathered=gathered,
        gather_received=received,
        reduce_sent=reduce_sent,
        exchange_sent=exchange,
        exchange_buffers=2 * rows if ep > 1 else 0,
        exchange_buffers_worst=(rows + rows * ep) if ep > 1 else 0,
        step_sent=step,
    )


@dataclass(frozen=True, kw_only=True)
class ExpertPlan:
    """The experts of a planned run: their shapes, the figures at every ``ep_size`` the mesh can take, the one the
    run has and the one proposed (None: keep it)."""

    shapes: ExpertShapes
    options: tuple[ExpertTraffic, ...]
    ep: int
    proposed: int | None
    tokens: int  # per rank and micro-batch (T)

    @property
    def current(self) -> ExpertTraffic:
        return next(o for o in self.options if o.ep == self.ep)

    def describe(self, human: Any) -> list[str]:
        s = self.shapes
        lines = [
            f"MoE: {len(s.layers)} layers of {', '.join(s.classes)}, {s.num_experts} experts (top {s.top_k}), "
            f"{s.expert_params / 1e9:.2f}B expert parameters ({100 * s.share:.0f}% of the model"
            + ("" if s.trained else "; frozen: LoRA")
            + f"); per rank and MoE layer, {self.tokens} tokens per rank and micro-batch:",
            f"  {'ep_size':>7} {'experts':>7} {'state':>10} {'gathered':>10} {'all-gather':>10} {'red-scat':>10} "
            f"{'all-to-all':>10} {'a2a buf':>10} {'per step':>10}",
        ]
        for o in self.options:
            mark = " <- run" if o.ep == self.ep else " <- proposed" if o.ep == self.proposed else ""
            lines.append(
                f"  {o.ep:>7} {o.experts_per_rank:>7} {human(o.sharded_bytes):>10} {human(o.gathered):>10} "
                f"{human(o.gather_received):>10} {human(o.reduce_sent):>10} {human(o.exchange_sent):>10} "
                f"{human(o.exchange_buffers):>10} {human(o.step_sent):>10}{mark}"
            )
        lines.append(
            "  (state: the experts' sharded parameters/gradients/AdamW, all layers; gathered: one layer's all-gather "
            "output; all-gather: received per gather, 2 per micro-batch; red-scat: sent per reduce-scatter; "
            "all-to-all: sent per token exchange, 4 per micro-batch, 6 when the layer is recomputed; a2a buf: one "
            "exchange's send + receive rows, balanced routing; per step: all of it, every MoE layer)"
        )
        if self.proposed is not None:
            flat, best = self.current, next(o for o in self.options if o.ep == self.proposed)
            lines.append(
                f"expert parallel: the experts are {100 * s.share:.0f}% of the parameters; ep_size {best.ep} moves "
                f"{human(best.step_sent)} per step and rank for them instead of {human(flat.step_sent)} "
                f"({best.step_sent / max(flat.step_sent, 1):.2f}x) and gathers {human(best.gathered)} of experts per "
                f"layer instead of {human(flat.gathered)}: set ep_size: {best.ep}"
            )
        return lines


def propose_ep(shapes: ExpertShapes, options: list[ExpertTraffic], current: int) -> int | None:
    """The ``ep_size`` to propose: when the experts dominate (:data:`DOMINANT_SHARE`) and the run has none, the one
    sending the fewest bytes per step (the larger on a tie), if fewer than flat FSDP2; else None."""
    if current != 1 or shapes.share < DOMINANT_SHARE or len(options) < 2:
        return None
    best = min(options, key=lambda o: (o.step_sent, -o.ep))
    return best.ep if best.ep != 1 and best.step_sent < options[0].step_sent else None


def expert_plan(model: torch.nn.Module, model_config: Any, settings: PlanSettings) -> ExpertPlan | None:
    """The experts of the run planned by ``settings`` (None for a dense model)."""
    from hf_fsdp2.plan.meta_model import layer_classes

    shapes = expert_shapes(model, model_config, layer_classes(model, settings))
    if shapes is None:
        return None
    sizes = ep_sizes(shapes, settings.shard_size)
    if settings.ep not in sizes:
        sizes = sorted({*sizes, settings.ep})
    options = [expert_traffic(shapes, settings, ep) for ep in sizes]
    return ExpertPlan(
        shapes=shapes,
        options=tuple(options),
        ep=settings.ep,
        proposed=propose_ep(shapes, options, settings.ep),
        tokens=settings.micro_batch * settings.seq_len // settings.cp,
    )
