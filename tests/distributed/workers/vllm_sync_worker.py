"""Worker for tests/distributed/test_vllm_sync.py: GRPO's vLLM weight sync and rollouts on a FSDP2-sharded tiny
Llama over 2 gloo ranks, counted, against the real server code over a stand-in engine (tests/support/vllm_standin.py).

1. Gather: every unit's full tensors in bf16 equal the unsharded weights cast to bf16; the all-gathers counted where
   torch dispatches them (tests/support/comm_count.py) equal the library's counts and the formula of
   hf_fsdp2/parallel/gather.py.
2. Server mode: rank 0 hosts the server (its HTTP handler, ``Engine`` and worker functions over a stand-in engine of
   2 workers, as ``--tensor-parallel-size 2``), the run connects (the weight group: rank 0 and the 2 workers) and
   syncs: each worker receives every tensor over the group, in bf16; the HTTP bodies are metadata; a generation batch
   is one engine call of its unique prompts with ``n``; an evaluation's per-rank prompts (2 on rank 0, none on rank 1)
   are one engine call too.
3. Colocate: each rank's engine sleeps at level 2 and wakes its weights, then its KV cache, around each rollout; its
   rollout is one call of its share's prompts with ``n``.
Every rank writes ``<out>/rank<r>.json``."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from support import vllm_standin as standin
from support.comm_count import CommCounter
from torch.distributed.fsdp import FSDPModule

from hf_fsdp2 import collectives
from hf_fsdp2.config.plans import CompilePlan, ShardingPlan
from hf_fsdp2.methods.grpo.rollout import SamplingSettings
from hf_fsdp2.methods.grpo.vllm.client import ServerSettings, VllmClient, VllmGenerator
from hf_fsdp2.methods.grpo.vllm.colocate import ColocateGenerator, LocalClient
from hf_fsdp2.model import decoder_layer_classes, load_model
from hf_fsdp2.parallel.accelerator import build_accelerator
from hf_fsdp2.parallel.gather import GatherCounts, gathered_units, sync_units
from hf_fsdp2.parallel.parallelize import ParallelPlan, parallelize

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]  # a generation batch's unique prompts
G, MAX_TOKENS, SEED = 4, 6, 100
EVAL = {0: [[20, 21], [22]], 1: []}  # rank 1 has no prompt and still takes part


def formula(model: torch.nn.Module, world: int, itemsize: int) -> tuple[int, int]:
    """Units with a parameter, and the bytes their all-gathers produce (gather.py's formula)."""
    units = sync_units(model)
    total = 0
    for unit in units:
        total += world * sum(math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) for _, p in unit)
    return len(units), total * itemsize


def cut(ids: list[int]) -> list[int]:
    end = next((i + 1 for i, t in enumerate(ids) if t == standin.EOS), len(ids))
    return ids[:end]


def main() -> None:
    sys.modules["vllm"] = standin.vllm_module()  # the server's SamplingParams (this process has no vLLM)
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    plan = ShardingPlan(activation_checkpointing=False)
    acc = build_accelerator(plan, mixed_precision="no", compile_plan=CompilePlan(enabled=False))
    rank, world = acc.process_index, acc.num_processes
    model = load_model(args.model)
    model = parallelize(
        model,
        acc,
        ParallelPlan(layer_cls=decoder_layer_classes(model), ac=plan.ac, compile=CompilePlan(enabled=False)),
    )
    plain = {k: v.to(torch.bfloat16) for k, v in load_model(args.model).state_dict().items()}
    report: dict = {
        "params": len(list(model.parameters())),
        "numel": sum(p.numel() for p in model.parameters()),
    }
    report["fsdp_units"] = sum(  # FSDP2's own parameter groups: the units it gathers in training
        bool(m._get_fsdp_state()._fsdp_param_groups) for m in model.modules() if isinstance(m, FSDPModule)
    )
    report["formula_units"], report["formula_bytes"] = formula(model, world, 2)

    # 1. the gathers, in bf16
    counts, counter = GatherCounts(), CommCounter()
    with counter:
        full = {
            n: t.clone()
            for u in gathered_units(sync_units(model), torch.bfloat16, True, counts)
            for n, t in u.tensors
        }
    report["gather"] = vars(counts)
    report["dispatched_all_gathers"] = counter.all_gathers()
    report["gather_equal"] = sorted(full) == sorted(plain) and all(
        torch.equal(full[n], plain[n]) for n in plain
    )

    # 2. server mode over the stand-in
    url, llm, bodies = "", None, []
    if rank == 0:
        llm = standin.LLM(workers=2, dtype="bfloat16")
        server, url, bodies = standin.serve(standin.engine(llm, "bfloat16"))
    url = collectives.broadcast_object(url)
    client = VllmClient(ServerSettings(url, timeout=30, request_timeout=60))
    settings = SamplingSettings(max_completion_length=MAX_TOKENS)
    cpu = torch.device("cpu")
    gen = VllmGenerator(
        model,
        client,
        eos_ids=[standin.EOS],
        settings=settings,
        probe=([1], [2]),
        compute_dtype="float32",
        device=cpu,
    )
    gen.check_probe = lambda: 0.0  # type: ignore[method-assign]  # the stand-in runs no model
    gen.connect()
    counter = CommCounter()
    with counter:
        gen.sync()
    assert gen.last_sync is not None
    report["sync"] = gen.last_sync.as_dict()
    report["sync_dispatched_all_gathers"] = counter.all_gathers()
    per_rank = len(PROMPTS) * G // world
    share = slice(rank * per_rank, (rank + 1) * per_rank)
    got = gen.generate_groups(PROMPTS, G, share, seed=SEED)
    report["rollout_equal"] = got == [
        cut(standin.completion_of(SEED + k, MAX_TOKENS)) for k in range(share.start, share.stop)
    ]
    report["rollout_logps"] = [len(lp) for lp in gen.take_logps()] == [len(c) for c in got]
    evaluated = gen.generate(EVAL[rank], seed=0, greedy=True)
    report["eval_count"] = len(evaluated)
    if llm is not None:
        report["server_calls"] = [{"prompts": c["prompts"], "n": c["n"]} for c in llm.calls]
        report["server_resets"] = llm.resets
        report["workers_equal"] = [
            sorted(w.loaded) == sorted(plain)
            and all(torch.equal(w.loaded[n], plain[n]) for n in plain)
            and all(w.loaded[n].dtype == torch.bfloat16 for n in plain)
            for w in llm.workers
        ]
        report["http"] = bodies
        server.shutdown()
    report["client_engine_calls"] = [gen.engine_calls, gen.engine_prompts]
    report["counted"] = gen.counted  # what the run logs as rollout/engine_* and rollout/sync_*

    # 3. colocate, sleep level 2, every rank its own stand-in engine
    weight_bytes = report["numel"] * 2
    local = standin.LLM(workers=1, dtype="bfloat16", weight_bytes=weight_bytes)
    colo = ColocateGenerator(
        model,
        LocalClient(standin.engine(local, "bfloat16")),
        eos_ids=[standin.EOS],
        settings=settings,
        probe=([1], [2]),
        compute_dtype="float32",
        device=cpu,
        sleep_mode=True,
    )
    colo.sleep_mode = True  # the stand-in sleeps on CPU (vLLM's CPU backend has no sleep mode)
    colo.server_dtype = "bfloat16"
    colo.check_probe = lambda: 0.0  # type: ignore[method-assign]
    colo.sleep()
    rollouts = []
    for number in range(2):
        rollouts.append(colo.generate_groups(PROMPTS, G, share, seed=SEED + 1000 * number))
        colo.mark_stale()
    report["colocate_equal"] = rollouts[0] == [
        cut(standin.completion_of(SEED + k, MAX_TOKENS)) for k in range(share.start, share.stop)
    ]
    report["colocate_events"] = local.events
    report["colocate_host_bytes"] = local.host_bytes
    report["colocate_calls"] = [{"prompts": c["prompts"], "n": c["n"]} for c in local.calls]
    report["colocate_weights_equal"] = all(torch.equal(local.workers[0].loaded[n], plain[n]) for n in plain)
    report["colocate_loads"] = local.workers[0].loads
    report["colocate_sync"] = colo.last_sync.as_dict() if colo.last_sync else None
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
