"""Mixture of experts on CPU: the experts' kernels alone, and expert parallel against flat FSDP2 (bytes and tokens/s).

    python bench/moe_bench.py kernels                 # one experts module: per-expert loop vs grouped_mm
    python bench/moe_bench.py ep --procs 4            # ep 1 / 2 / 4 on 4 gloo ranks: bytes per step, tokens/s

``kernels``: one Qwen3-MoE experts module (``--hidden`` 1024, ``--inter`` 384, ``--experts`` 64, top ``--top-k`` 8:
Qwen3-30B-A3B's proportions at half its width) on ``--tokens`` 4096 tokens (a rank's micro-batch of 2 x 2048),
routed by a random router, forward + backward, fp32 (this CPU has no bf16 units), through each implementation
transformers 5 has: ``eager`` (the class's own loop: one matmul per expert that has tokens), ``grouped_mm``
(``torch.nn.functional.grouped_mm``: every (token, choice) row in one grouped matmul), and ``grouped_mm`` under the
fallback transformers takes when the kernel cannot run (``transformers::grouped_mm_fallback``: a loop of one matmul
per expert over the same sorted rows; under ``torch.compile`` with non-bf16 weights, on pre-Ampere GPUs). The median
of ``--repeats`` after one warm-up; the outputs checked equal.

``ep``: a Qwen3-MoE whose expert stack dominates (``--hidden`` 256, ``--layers`` 4, ``--experts`` 16 of
``--inter`` 512, top 2: the experts are ~96% of its 27M parameters), random-init with one seed, fp32, trained
``--steps`` steps of ``--rows`` x ``--length`` tokens per rank (the same batches for every layout) on ``--procs``
gloo ranks: flat FSDP2 (``fully_shard`` per decoder layer and at the root, as the recipe's path does) and expert
parallel at each ``--eps`` (the library's: the experts split over ``ep`` ranks, exchanged tokens, each layer one
FSDP2 unit with the experts on their own ``efsdp`` mesh). Every collective of the step is wrapped and counted, per
rank: the bytes an all-gather brings from other ranks (its output less the rank's own input), a reduce-scatter and
an all-to-all send to other ranks (input less the rank's own part), an all-reduce (2 (g - 1) / g of the tensor, a
ring's). Per layout: ``MiB/step`` (mean of the counted steps, rank 0), the share of each collective, ``tokens/s``
(every rank's tokens over the median step time after ``--warmup`` steps), and the first step's loss (the same model
and data: equal across layouts up to fp32 rounding). Each layout runs in its own ``torchrun``.

Each prints a Markdown table and, with ``--json``, writes its figures. Measured figures and commands:
docs/fsdp2-guide.md (MoE models).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _experts(hidden: int, inter: int, experts: int, top_k: int, implementation: str) -> Any:
    import torch
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = transformers.Qwen3MoeConfig(
        hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts, num_experts_per_tok=top_k
    )
    config._experts_implementation = implementation
    torch.manual_seed(0)
    module = Qwen3MoeExperts(config)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02)
    return module


def _fallback(module: Any) -> Any:
    """``module``'s grouped_mm forward with transformers' fallback loop in place of the kernel (what it runs where
    ``_can_use_grouped_mm`` is false)."""
    import transformers.integrations.moe as moe

    def forward(*args: Any) -> Any:
        saved = moe._can_use_grouped_mm
        moe._can_use_grouped_mm = lambda *a: False  # type: ignore[assignment]
        try:
            return module(*args)
        finally:
            moe._can_use_grouped_mm = saved

    return forward


def kernels(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Forward + backward of one experts module per implementation; rows and times."""
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(args.tokens, args.hidden, generator=gen)
    logits = torch.randn(args.tokens, args.experts, generator=gen)
    weights, index = torch.topk(logits.softmax(-1), args.top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    runs = {
        "eager (per-expert loop)": _experts(args.hidden, args.inter, args.experts, args.top_k, "eager"),
        "grouped_mm": _experts(args.hidden, args.inter, args.experts, args.top_k, "grouped_mm"),
    }
    fallback = _experts(args.hidden, args.inter, args.experts, args.top_k, "grouped_mm")
    calls = {name: m for name, m in runs.items()}
    calls["grouped_mm fallback (loop)"] = _fallback(fallback)
    results, reference = [], None
    for name, call in calls.items():
        times = []
        for i in range(args.repeats + 1):
            x = hidden.clone().requires_grad_(True)
            start = time.perf_counter()
            out = call(x, index, weights)
            out.square().sum().backward()
            if i:
                times.append(time.perf_counter() - start)
        reference = out.detach() if reference is None else reference
        results.append(
            {
                "implementation": name,
                "ms": round(1000 * statistics.median(times), 1),
                "max_diff": float((out.detach() - reference).abs().max()),
            }
        )
    base = next(r["ms"] for r in results if r["implementation"] == "grouped_mm")
    for r in results:
        r["vs_grouped_mm"] = round(r["ms"] / base, 2)
    params = 3 * args.hidden * args.inter * args.experts
    print(
        f"experts forward + backward: {args.experts} experts of {args.hidden} x {args.inter} ({params / 1e6:.1f}M "
        f"parameters), {args.tokens} tokens x top {args.top_k} = {args.tokens * args.top_k} rows, fp32, "
        f"{torch.get_num_threads()} threads, median of {args.repeats}"
    )
    print("| implementation | ms | x grouped_mm | max |diff| |\n|---|---|---|---|")
    for r in results:
        print(f"| {r['implementation']} | {r['ms']} | {r['vs_grouped_mm']} | {r['max_diff']:.1e} |")
    return results


_COUNTED = ("all_gather_single", "reduce_scatter_single", "all_to_all_single", "all_reduce", "broadcast")


def _count_collectives(tally: dict[str, int]) -> None:
    """Wrap torch.distributed's collectives (FSDP2 and expert parallel call them through the module): each adds the
    bytes this rank receives (all-gather) or sends (the others) to ``tally[name]``."""
    import torch.distributed as dist

    def group_of(kwargs: dict[str, Any]) -> tuple[int, int]:
        group = kwargs.get("group")
        return dist.get_world_size(group), dist.get_rank(group)

    def wrap(name: str, fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            size, me = group_of(kwargs)
            if name == "all_gather_single":
                out, inp = (
                    kwargs.get("output_tensor", args[0] if args else None),
                    kwargs.get("input_tensor", args[1] if len(args) > 1 else None),
                )
                moved = out.numel() * out.element_size() - inp.numel() * inp.element_size()
            elif name == "reduce_scatter_single":
                out, inp = (
                    kwargs.get("output", args[0] if args else None),
                    kwargs.get("input", args[1] if len(args) > 1 else None),
                )
                moved = inp.numel() * inp.element_size() - out.numel() * out.element_size()
            elif name == "all_to_all_single":
                inp = kwargs.get("input", args[1] if len(args) > 1 else None)
                splits = kwargs.get("input_split_sizes", args[3] if len(args) > 3 else None)
                row = inp[0].numel() * inp.element_size() if inp.dim() and inp.shape[0] else 0
                own = splits[me] * row if splits else inp.numel() * inp.element_size() // size
                moved = inp.numel() * inp.element_size() - own
            elif name == "all_reduce":
                t = args[0] if args else kwargs["tensor"]
                moved = 2 * (size - 1) * t.numel() * t.element_size() // size
            else:
                t = args[0] if args else kwargs["tensor"]
                moved = (
                    0
                    if me == kwargs.get("src", args[1] if len(args) > 1 else 0)
                    else t.numel() * t.element_size()
                )
            tally[name] = tally.get(name, 0) + moved
            return fn(*args, **kwargs)

        return counted

    for name in _COUNTED:
        setattr(dist, name, wrap(name, getattr(dist, name)))


def _bench_model(args: argparse.Namespace) -> Any:
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        moe_intermediate_size=args.inter,
        num_hidden_layers=args.layers,
        num_attention_heads=max(args.hidden // 64, 1),
        num_key_value_heads=max(args.hidden // 128, 1),
        head_dim=64,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        tie_word_embeddings=False,
        max_position_embeddings=max(2048, args.length),
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # a router that spreads tokens (random init, not all to a few experts)
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.02)
    return model


def ep_child(args: argparse.Namespace) -> None:
    """One layout on every rank of this torchrun: train, count, print ``RESULT {json}`` on rank 0."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("WORLD_SIZE", "1"))))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _bench_model(args)
    params = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for layer in model.model.layers for p in layer.mlp.experts.parameters())
    if args.ep > 1:
        from hf_fsdp2.config.plans import MeshPlan
        from hf_fsdp2.parallel.expert_parallel import apply_expert_parallel
        from hf_fsdp2.parallel.expert_shard import expert_meshes, shard_expert_layers

        meshes = expert_meshes(MeshPlan(dp_shard=world, ep=args.ep), "cpu")
        apply_expert_parallel(model, meshes.ep)
        shard_expert_layers(model, ("Qwen3MoeDecoderLayer",), meshes, mesh=None, fsdp_kwargs={}, upcast=False)
    else:
        for layer in model.model.layers:
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    batches = [
        torch.randint(0, args.vocab, (world * args.rows, args.length), generator=gen)
        for _ in range(args.steps)
    ]
    tally: dict[str, int] = {}
    _count_collectives(tally)
    losses, times, per_step = [], [], []
    for step, ids in enumerate(batches):
        mine = ids[rank * args.rows : (rank + 1) * args.rows]
        before = dict(tally)
        dist.barrier()
        start = time.perf_counter()
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
        if step >= args.warmup:
            per_step.append({k: v - before.get(k, 0) for k, v in tally.items()})
    if rank == 0:
        counted = max(len(per_step), 1)
        moved = {k: sum(s.get(k, 0) for s in per_step) / counted for k in _COUNTED}
        step_s = statistics.median(times[args.warmup :] or times)
        print(
            "RESULT "
            + json.dumps(
                {
                    "layout": "flat FSDP2" if args.ep == 1 else f"ep {args.ep}",
                    "ep": args.ep,
                    "procs": world,
                    "params_m": round(params / 1e6, 2),
                    "expert_share": round(experts / params, 3),
                    "bytes_per_step": int(sum(moved.values())),
                    "bytes": {k: int(v) for k, v in moved.items() if v},
                    "step_s": round(step_s, 4),
                    "tokens_per_s": round(world * args.rows * args.length / step_s, 1),
                    "first_loss": losses[0],
                    "losses": [round(v, 4) for v in losses],
                }
            ),
            flush=True,
        )
    dist.destroy_process_group()


def ep_main(args: argparse.Namespace, run: Any = None) -> list[dict[str, Any]]:
    """Each layout in its own ``torchrun`` (``run``: ``subprocess.run`` or the tests' stand-in); the table."""
    import subprocess

    run = run or subprocess.run
    results: list[dict[str, Any]] = []
    for ep in [int(e) for e in args.eps.split(",")]:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(args.procs),
            "--master_port",
            str(29500 + (os.getpid() + ep) % 1000),
            __file__,
            "ep-child",
            f"--ep={ep}",
            *[
                f"--{k.replace('_', '-')}={v}"
                for k, v in vars(args).items()
                if k
                in (
                    "hidden",
                    "inter",
                    "layers",
                    "experts",
                    "top_k",
                    "vocab",
                    "rows",
                    "length",
                    "steps",
                    "warmup",
                )
            ],
        ]
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // args.procs)))
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        proc = run(cmd, capture_output=True, text=True, env=env, cwd=REPO, check=False)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not line:
            raise SystemExit(f"ep {ep} failed:\n{proc.stderr[-4000:]}")
        results.append(json.loads(line[0][7:]))
    flat = next((r for r in results if r["ep"] == 1), results[0])
    first = results[0]
    print(
        f"{first['params_m']}M-parameter MoE ({100 * first['expert_share']:.0f}% experts), {args.procs} gloo ranks, "
        f"{args.rows} x {args.length} tokens per rank and step, fp32; bytes per step and rank (sent, or received by "
        "all-gathers), mean of the steps after the warm-up"
    )
    print(
        "| layout | MiB/step | x flat | all-gather | reduce-scatter | all-to-all | all-reduce | tokens/s | x flat | loss 1 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        b = r["bytes"]
        r["bytes_vs_flat"] = round(r["bytes_per_step"] / max(flat["bytes_per_step"], 1), 3)
        r["speed_vs_flat"] = round(r["tokens_per_s"] / flat["tokens_per_s"], 3)
        print(
            f"| {r['layout']} | {r['bytes_per_step'] / 2**20:.1f} | {r['bytes_vs_flat']} | "
            + " | ".join(
                f"{b.get(k, 0) / 2**20:.1f}"
                for k in ("all_gather_single", "reduce_scatter_single", "all_to_all_single", "all_reduce")
            )
            + f" | {r['tokens_per_s']} | {r['speed_vs_flat']} | {r['first_loss']:.5f} |"
        )
    return results


def main(argv: list[str] | None = None, run: Any = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    k = sub.add_parser("kernels", help="one experts module: per-expert loop vs grouped_mm")
    k.add_argument("--hidden", type=int, default=1024)
    k.add_argument("--inter", type=int, default=384)
    k.add_argument("--experts", type=int, default=64)
    k.add_argument("--top-k", type=int, default=8)
    k.add_argument("--tokens", type=int, default=4096)
    k.add_argument("--repeats", type=int, default=3)
    k.add_argument("--json", default=None)
    for name in ("ep", "ep-child"):
        e = sub.add_parser(name, help="flat FSDP2 vs expert parallel: bytes per step, tokens/s")
        e.add_argument("--procs", type=int, default=4)
        e.add_argument("--eps", default="1,2,4", help="ep sizes (1: flat FSDP2)")
        e.add_argument("--ep", type=int, default=1, help=argparse.SUPPRESS)
        e.add_argument("--hidden", type=int, default=256)
        e.add_argument("--inter", type=int, default=512)
        e.add_argument("--layers", type=int, default=4)
        e.add_argument("--experts", type=int, default=16)
        e.add_argument("--top-k", type=int, default=2)
        e.add_argument("--vocab", type=int, default=1024)
        e.add_argument("--rows", type=int, default=4, help="sequences per rank and step")
        e.add_argument("--length", type=int, default=128)
        e.add_argument("--steps", type=int, default=8)
        e.add_argument("--warmup", type=int, default=2)
        e.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.what == "ep-child":
        ep_child(args)
        return
    results = ep_main(args, run) if args.what == "ep" else kernels(args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
