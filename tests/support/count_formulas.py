"""The counts the GPU checks hold their benches to, as functions of the run's shape (pure arithmetic: no GPU, no
process group), so that tests/unit/test_gpu_formulas.py can hold them to counts measured on CPU with the same
benches and show that a count off the formula fails.

- :func:`tp_step_collectives`: one training step of ``bench/gpu_bench_parallel.py`` under tensor parallel 2 x FSDP2
  2 (docs/performance.md, "Tensor parallel: collectives per step"); tests/distributed/test_tensor_parallel.py holds
  a bf16 forward and backward (no checkpointing and full) in the suite to it, less the step's own all-reduces.
- :func:`ep_step_bytes`: the bytes ``bench/moe_bench.py ep`` counts per step and rank, flat FSDP2 against expert
  parallel (docs/fsdp2-guide.md, "MoE models").
- :func:`rollout_counts`: what a GRPO step's vLLM rollout and weight load may count (docs/grpo.md, "What a weight
  sync and a rollout cost").
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

# Held to the balanced-routing formula within this factor: the bench's router is random (uneven splits; measured
# 1.06x at ep 2 on the check's model and batches, 0.93x at ep 4 on the bench's default); a doubled exchange, an
# exchange in another dtype or the experts gathered instead fall outside it.
ALL_TO_ALL_BAND = (0.75, 1.25)


def tp_step_collectives(layers: int, chunks: int, ac: str) -> dict[str, int]:
    """A Llama step's collectives on one rank (CollectiveCounter, eager), tensor parallel over 2 ranks (torchtitan's
    layout: sequence parallel norms, ``PrepareModuleInput`` per block, loss parallel under the chunked loss) inside
    FSDP2 per decoder layer and at the root over the data ranks; ``chunks``: the chunked loss's chunks.

    - tensor parallel, per layer 2 all-gathers + 2 reduce-scatters forward and again backward; on top forward 1
      all-gather of the head's input, ``chunks`` of the loss's ``[3 x chunk]`` blocks and 1 of the one-position
      logits, 1 all-reduce (the vocabulary-split embedding); backward 1 reduce-scatter (the head's input) and 1
      all-gather (the first layer's input gradient); at FSDP2's reduction one all-reduce per norm weight (2L + 1);
    - full activation checkpointing: the recompute repeats per layer the 2 all-gathers into attention and the MLP and
      attention's reduce-scatter;
    - FSDP2: each layer gathered in the forward and again in the backward, the root once; one reduce-scatter per unit;
    - the step's own: 3 all-reduces (the token counts, the gradient norm over the data and the tp dimension).
    """
    recompute = layers if ac == "full" else 0
    return {
        "all_gather": (4 * layers + 3 + chunks) + (2 * layers + 1) + 2 * recompute,
        "reduce_scatter": (4 * layers + 1) + (layers + 1) + recompute,
        "all_reduce": 1 + (2 * layers + 1) + 3,
    }


def _shard_rows(params: Iterable[Any], ranks: int) -> int:
    """Elements of one rank's FSDP2 shard of ``params``: dim 0 padded to a multiple of ``ranks``."""
    return sum(math.ceil(p.shape[0] / ranks) * (p.numel() // max(p.shape[0], 1)) for p in params)


def ep_step_bytes(model: Any, *, ranks: int, ep: int, tokens: int, itemsize: int = 4) -> dict[str, float]:
    """The bytes one rank moves per step in ``bench/moe_bench.py ep`` (its counting: all-gathers what they bring
    from other ranks, reduce-scatters and all-to-alls what they send to them), for ``model`` (its decoder layers
    ``model.model.layers``, experts ``layer.mlp.experts``) on ``ranks`` ranks at ``ep`` (1: flat FSDP2; ``ranks``:
    each rank its own experts, none gathered), ``tokens`` per rank and step, no activation checkpointing.

    - all-gather: ``(ranks - 1) x shard`` per gather, each layer gathered in the forward and again in the backward,
      the root once; at ``ep == ranks`` the experts are gathered over 1 rank (nothing moves);
    - reduce-scatter: ``(ranks - 1) x shard`` of every unit, once;
    - all-to-all (``ep > 1``, balanced routing): ``4 x tokens x top_k x hidden x (ep - 1) / ep`` per MoE layer
      (the rows to their experts and back, forward and backward) and the routing counts (``experts`` int64 per
      layer and forward); held within :data:`ALL_TO_ALL_BAND`.
    """
    if ep not in (1, ranks):
        raise ValueError(f"ep {ep}: the formula covers flat (1) and one expert group over all {ranks} ranks")
    layers = list(model.model.layers)
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    root = _shard_rows([p for p in model.parameters() if id(p) not in in_layers], ranks)
    dense = _shard_rows([p for layer in layers for p in layer.parameters()], ranks)
    if ep > 1:
        dense -= _shard_rows([p for layer in layers for p in layer.mlp.experts.parameters()], ranks)
    moved = (ranks - 1) * itemsize
    out: dict[str, float] = {
        "all_gather_single": moved * (2 * dense + root),
        "reduce_scatter_single": moved * (dense + root),
    }
    if ep > 1:
        config = model.config
        rows = 4 * tokens * config.num_experts_per_tok * config.hidden_size * itemsize
        counts = config.num_experts * 8
        out["all_to_all_single"] = len(layers) * (rows + counts) * (ep - 1) / ep
    return out


def rollout_counts(*, prompts: int, procs: int, units: int, params: int, itemsize: int) -> dict[str, Any]:
    """A GRPO step's rollout through vLLM with ``procs`` training ranks and one engine per rank (colocate, tensor
    parallel 1) or one server: the engine calls and prompts summed over the engines, the weight load's per rank, for
    the steps after the first (the first load finds the root unsharded after the start-up probe: fewer gathers).

    - engine calls: 1 per engine (each engine gets its ranks' completions in one call);
    - prompts prefilled: the generation batch's unique prompts once each (``n`` = the group's completions there):
      ``prompts`` (B / G) on one engine;
    - all-gathers: one per FSDP unit, in the engine's dtype: the parameters' ``itemsize`` bytes (one rank: no
      padding);
    - host bytes: 0 (no shard staged through host memory).
    """
    return {
        "engine_calls": procs,
        "engine_prompts": prompts,
        "all_gathers": units,
        "gathered_bytes": params * itemsize,
        "host_bytes": 0,
    }


def ep_failures(measured: dict[int, dict[str, float]], expected: dict[int, dict[str, float]]) -> list[str]:
    """What in ``bench/moe_bench.py ep``'s bytes per step (``{ep: {collective: bytes}}``) leaves
    :func:`ep_step_bytes`'s ``expected``: FSDP2's bytes by one byte, an all-to-all under flat FSDP2, an exchange outside
    :data:`ALL_TO_ALL_BAND`. Empty: every count on its formula."""
    low, high = ALL_TO_ALL_BAND
    out = []
    for ep, want in expected.items():
        got = measured[ep]
        for kind in ("all_gather_single", "reduce_scatter_single"):
            if got.get(kind, 0) != want[kind]:
                out.append(f"ep {ep}: {kind} {got.get(kind, 0)} bytes, formula {want[kind]}")
        exchanged = got.get("all_to_all_single", 0)
        if ep == 1 and exchanged:
            out.append(f"flat FSDP2 sent {exchanged} bytes by all-to-all")
        if ep > 1 and not low <= exchanged / want["all_to_all_single"] <= high:
            out.append(
                f"ep {ep}: all-to-all {exchanged} bytes, {exchanged / want['all_to_all_single']:.2f}x balanced"
            )
    return out


def rollout_failures(row: dict[str, float], want: dict[str, Any], broadcast: int) -> list[str]:
    """What in a ``bench/grpo_bench.py`` row (its ``*_per_step`` counts) leaves :func:`rollout_counts`'s ``want``;
    ``broadcast``: the bytes the update must broadcast (the server: every parameter's; colocate: 0)."""
    pairs = {
        "engine_calls_per_step": want["engine_calls"],
        "engine_prompts_per_step": want["engine_prompts"],
        "sync_all_gathers_per_step": want["all_gathers"],
        "sync_gathered_bytes_per_step": want["gathered_bytes"],
        "sync_host_bytes_per_step": want["host_bytes"],
        "sync_broadcast_bytes_per_step": broadcast,
    }
    return [f"{key} {row.get(key)}, formula {value}" for key, value in pairs.items() if row.get(key) != value]
