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
# bench_launch lives beside this file (bench/ is not a package): importable also when a test loads this file by path.
for _path in (REPO, Path(__file__).resolve().parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))


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


# Qwen3-30B-A3B's shape (its config.json): 48 MoE layers of 128 experts (top 8), hidden 2048, expert width 768, 32 query
# / 4 KV heads of 128; "tiny" for --smoke (CPU, gloo).
QWEN3_30B_A3B = {
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "tie_word_embeddings": False, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
}  # fmt: skip
TINY = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_experts": 8, "num_experts_per_tok": 2, "tie_word_embeddings": False,
}  # fmt: skip
GPU_SMOKE = {
    "cpu": True,
    "procs": 2,
    "eps": "1,2",
    "layers": None,
    "seq": 64,
    "rows": 1,
    "warmup": 1,
    "steps": 1,
}


def gpu_config(args: argparse.Namespace) -> Any:
    """The Qwen3-MoE config of the run: ``--shape``, with ``--layers`` decoder layers when given."""
    import transformers

    shape = dict(TINY if args.shape == "tiny" else QWEN3_30B_A3B)
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    config = transformers.Qwen3MoeConfig(**shape, max_position_embeddings=max(4096, args.seq))
    config._attn_implementation = "sdpa"
    config.use_cache = False
    return config


def meta_model(config: Any) -> Any:
    import torch
    import transformers

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def gpu_flops(model: Any) -> Any:
    """hf_fsdp2's meter's FLOPs model of ``model`` (unsharded or meta), as the recipe builds it: ``6N + 12LHQT`` with
    ``N`` the non-embedding parameters a token runs (each layer's routed experts at top_k / experts)."""
    from hf_fsdp2.observe.flops import active_non_embedding_params, flops_model

    return flops_model(model.config, active_non_embedding_params(model))


def gpu_step_flops(flops: Any, args: argparse.Namespace) -> float:
    """FLOPs of one step per device as the meter charges them: every rank's ``--rows`` rows of ``--seq`` tokens (no
    padding: random ids, no pad token), the sum over ranks shared by the ``--procs`` devices."""
    return float(flops.for_sequences([args.seq] * args.rows))


def gpu_plan(args: argparse.Namespace, ep: int, model: Any) -> dict[str, Any]:
    """What one layout will run, checked as a run checks it (anywhere, no device): the mesh, the experts' split, the
    FLOPs per device and step, and with ``--plan-memory`` the memory plan's peak per GPU (``hf-fsdp2 plan``'s).
    ``model``: the run's model on the meta device."""
    from hf_fsdp2.config.plans import MeshPlan, check_expert_mesh, check_mesh
    from hf_fsdp2.parallel.experts import check_expert_split, read_experts

    config = model.config
    mesh = MeshPlan(dp_shard=args.procs, ep=ep)
    check_mesh(
        mesh, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads, max_length=args.seq
    )
    if ep > 1:  # the run's refusals, before any launch
        check_expert_mesh(mesh)
        check_expert_split(read_experts(model), mesh)
    layers = config.num_hidden_layers
    flops = gpu_flops(model)
    plan: dict[str, Any] = {
        "ep": ep,
        "procs": args.procs,
        "layers": layers,
        "mesh": mesh.describe(),
        "active_params_b": round(flops.non_embedding_params / 1e9, 3),
        "tflop_per_device_per_step": round(gpu_step_flops(flops, args) / 1e12, 3),
        "tokens_per_step": args.procs * args.rows * args.seq,
    }
    if args.plan_memory:
        plan["planned_peak_gib"] = round(planned_peak(config, args, ep) / 2**30, 2)
    return plan


def planned_peak(config: Any, args: argparse.Namespace, ep: int) -> int:
    """The memory plan's peak bytes per GPU of the worst rank (bf16 compute, fp32 masters, AdamW)."""
    from hf_fsdp2.config.plans import ACPlan
    from hf_fsdp2.plan import PlanSettings, plan_memory

    settings = PlanSettings(
        world_size=args.procs,
        ep=ep,
        micro_batch=args.rows,
        seq_len=args.seq,
        ac=ACPlan(args.ac),
        mixed_precision="bf16",
        ce_chunk_tokens=4096,
        device_type="cuda",
        attn_implementation="sdpa",
    )
    return int(plan_memory(config, settings).peak)


def largest_fitting_layers(args: argparse.Namespace, gib: float) -> int:
    """The most decoder layers of ``--shape`` whose planned peak on one GPU (ep 1, ``--procs`` 1) stays under
    ``gib`` less the plan's 10% headroom (bisection over 1 .. the shape's layers)."""
    import copy

    from hf_fsdp2.plan import DEFAULT_HEADROOM

    budget = gib * 2**30 * (1 - DEFAULT_HEADROOM)
    probe = copy.copy(args)
    probe.procs = 1
    low, high = 0, (TINY if args.shape == "tiny" else QWEN3_30B_A3B)["num_hidden_layers"]
    while low < high:
        mid = (low + high + 1) // 2
        probe.layers = mid
        if planned_peak(gpu_config(probe), probe, 1) <= budget:
            low = mid
        else:
            high = mid - 1
    if low == 0:
        raise SystemExit(
            f"--fit-gib {gib}: not even one layer of {args.shape} fits (planned peak over the budget)"
        )
    return low


def gpu_launch_line(args: argparse.Namespace, ep: int, out: Path, port: int) -> list[str]:
    """The torchrun command of one layout (its ranks run ``gpu-child``)."""
    flags = [
        "gpu-child", f"--ep={ep}", f"--procs={args.procs}", f"--shape={args.shape}", f"--seq={args.seq}",
        f"--rows={args.rows}", f"--ac={args.ac}", f"--warmup={args.warmup}", f"--steps={args.steps}",
        f"--worker={out}",
    ]  # fmt: skip
    flags += [f"--layers={args.layers}"] * bool(args.layers) + ["--eager"] * args.eager + ["--cpu"] * args.cpu
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.procs),
        "--master_addr", "127.0.0.1", "--master_port", str(port), str(Path(__file__).resolve()), *flags,
    ]  # fmt: skip


def _materialize(model: Any, device: Any, config: Any, seed: int) -> None:
    """The sharded meta model's storage on ``device``, random-initialised shard by shard (norms at 1, the rest
    N(0, 0.02): a random-init model trains the same FLOPs), and the rotary tables recomputed (``to_empty`` leaves
    buffers empty)."""
    import torch
    from torch.distributed.tensor import DTensor

    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            if name.endswith("norm.weight"):
                local.fill_(1.0)
            else:
                local.normal_(0.0, 0.02, generator=gen)
        for module in model.modules():
            if hasattr(module, "inv_freq") and hasattr(module, "rope_type"):
                fresh = type(module)(config).to(device)
                for name, buf in fresh.named_buffers():
                    getattr(module, name).copy_(buf)


def gpu_child(args: argparse.Namespace) -> None:
    """One layout on every rank of this torchrun: build (meta, then sharded and materialised), train, time; rank 0
    writes the JSON. Every piece is the library's as the recipe builds it: the mesh, expert parallel, activation
    checkpointing, regional compile, FSDP2 (bf16 compute over fp32 masters), the step (chunked loss), AdamW."""
    import torch

    from hf_fsdp2 import collectives
    from hf_fsdp2.config.plans import ACPlan, CompilePlan, MeshPlan, ShardingPlan
    from hf_fsdp2.observe.comms import CollectiveCounter
    from hf_fsdp2.observe.flops import peak_flops_for
    from hf_fsdp2.parallel.accelerator import build_accelerator
    from hf_fsdp2.parallel.expert_shard import expert_meshes
    from hf_fsdp2.parallel.parallelize import ExpertParallel, ParallelPlan, parallelize
    from hf_fsdp2.train.loss import plan_loss
    from hf_fsdp2.train.optim import build_adamw, param_groups
    from hf_fsdp2.train.step import StepSettings, train_step

    gpu = not args.cpu
    result: dict[str, Any] = {"ep": args.ep, "layout": "flat FSDP2" if args.ep == 1 else f"ep {args.ep}"}
    try:
        mesh = MeshPlan(dp_shard=args.procs, ep=args.ep)
        sharding = ShardingPlan(activation_checkpointing=ACPlan(args.ac, pin_memory=gpu))
        compile_plan = CompilePlan(enabled=gpu and not args.eager, scope="regional")
        acc = build_accelerator(
            sharding,
            mixed_precision="bf16" if gpu else "no",
            compile_plan=compile_plan,
            force_cpu=not gpu,
            mesh=mesh,
        )
        device = acc.device
        config = gpu_config(args)
        model = meta_model(config)
        flops = gpu_flops(model)
        experts = ExpertParallel(expert_meshes(mesh, device.type)) if args.ep > 1 else None
        plan = ParallelPlan(
            layer_cls=("Qwen3MoeDecoderLayer",), ep=experts, ac=sharding.ac, compile=compile_plan
        )
        model = parallelize(model, acc, plan)
        _materialize(model, device, config, seed=collectives.rank())
        opt = build_adamw(
            param_groups(model, 0.0), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, device_type=device.type
        )
        settings = StepSettings(plan_loss(model, 4096), max_grad_norm=1.0)
        gen = torch.Generator().manual_seed(1000 + collectives.rank())  # each rank its own rows
        rows = [
            torch.randint(0, config.vocab_size, (args.rows, args.seq), generator=gen)
            for _ in range(args.warmup + args.steps + 1)
        ]
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

        def step(ids: Any) -> Any:
            return train_step(model, opt, None, [{"input_ids": ids, "labels": ids.clone()}], settings, device)

        outs = [step(ids) for ids in rows[: args.warmup]]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        outs += [step(ids) for ids in rows[args.warmup : -1]]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        # One more step, untimed and eager, its collectives counted by kind (calls) and in bytes this rank moves.
        tally: dict[str, int] = {}
        _count_collectives(tally)
        with torch.compiler.set_stance("force_eager"), CollectiveCounter() as counter:
            step(rows[-1])
        result["collectives_per_step"] = counter.counts()
        result["mib_per_step"] = {k: round(v / 2**20, 1) for k, v in tally.items() if v}
        losses = [float(o.loss()) for o in outs]
        step_s = seconds / args.steps
        per_device = gpu_step_flops(flops, args)  # each rank its rows: FLOPs per device = one rank's
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        peak = peak_flops_for(name) if device.type == "cuda" else None
        memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
        result.update(
            {
                "tokens_per_s": args.procs * args.rows * args.seq / step_s,
                "step_s": step_s,
                "tflops_per_device": per_device / step_s / 1e12,
                "mfu": per_device / step_s / peak if peak else None,
                "losses": losses,
                "max_mem_allocated_gib": collectives.all_reduce_max([memory])[0] if gpu else None,
                "device": name,
            }
        )
    except Exception as err:  # noqa: BLE001  # reported for this layout; the others still run
        import traceback

        result["error"] = f"{type(err).__name__}: {err}"[:2000]
        result["traceback"] = traceback.format_exc()[-3000:]
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.worker).write_text(json.dumps(result))


def gpu_main(args: argparse.Namespace, run: Any = None) -> dict[str, Any]:
    """Each ``--eps`` layout in its own torchrun (``run``: subprocess.run or the tests' stand-in); ``--dry-run``: the
    plans and command lines only. Prints one JSON line per layout; returns the report."""
    import subprocess
    import tempfile

    from bench_launch import free_port, run_child

    run = run or subprocess.run
    if args.fit_gib:
        args.layers = largest_fitting_layers(args, args.fit_gib)
    report: dict[str, Any] = {"shape": args.shape, "procs": args.procs, "seq": args.seq, "rows": args.rows}
    model = meta_model(gpu_config(args))
    report["layers"] = model.config.num_hidden_layers
    report["results"] = []
    work = Path(tempfile.mkdtemp(prefix="moe_bench-"))
    for ep in [int(e) for e in str(args.eps).split(",") if e]:
        entry = gpu_plan(args, ep, model)
        out = work / f"ep{ep}.json"
        cmd = gpu_launch_line(args, ep, out, free_port())
        entry["launch"] = " ".join(cmd[1:])
        if not args.dry_run:
            entry.update(run_child(run, cmd, out, args.timeout_s))
        report["results"].append(entry)
        keys = (
            ("ep", "layers", "mesh", "tflop_per_device_per_step", "planned_peak_gib", "launch")
            if args.dry_run
            else ("ep", "tokens_per_s", "mfu", "tflops_per_device", "step_s", "max_mem_allocated_gib",
                  "mib_per_step", "error")
        )  # fmt: skip
        print(json.dumps({k: v for k, v in entry.items() if k in keys}), flush=True)
    return report


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
    for name in ("gpu", "gpu-child"):
        g = sub.add_parser(
            name, help="Qwen3-30B-A3B shapes on GPUs: tokens/s and MFU at each ep size (NCCL, bf16)"
        )
        g.add_argument("--procs", type=int, default=8, help="processes (GPUs) of each layout's torchrun")
        g.add_argument("--eps", default="1,8", help="ep sizes, comma-separated (1: flat FSDP2)")
        g.add_argument("--ep", type=int, default=1, help=argparse.SUPPRESS)
        g.add_argument("--shape", choices=("qwen3-30b-a3b", "tiny"), default="qwen3-30b-a3b")
        g.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's, 48)")
        g.add_argument("--seq", type=int, default=4096, help="tokens per row")
        g.add_argument("--rows", type=int, default=1, help="rows per rank and step (the micro-batch)")
        g.add_argument("--ac", choices=("none", "full"), default="full", help="activation checkpointing")
        g.add_argument(
            "--eager", action="store_true", help="no torch.compile (default: regional compile on GPU)"
        )
        g.add_argument("--warmup", type=int, default=2)
        g.add_argument("--steps", type=int, default=5)
        g.add_argument("--cpu", action="store_true", help="gloo on CPU, fp32 (what --smoke uses)")
        g.add_argument(
            "--smoke", action="store_true", help="tiny shape, ep 1 and 2 on 2 CPU processes, 1+1 steps"
        )
        g.add_argument(
            "--dry-run", action="store_true", help="check and print the plans and launch lines only"
        )
        g.add_argument("--plan-memory", action="store_true", help="with the memory plan's peak per GPU")
        g.add_argument(
            "--fit-gib", type=float, default=None,
            help="one GPU of this many GiB: the most layers whose planned peak fits (less 10%% headroom)",
        )  # fmt: skip
        g.add_argument(
            "--timeout-s", type=float, default=1800.0, help="one layout's torchrun is stopped after"
        )
        g.add_argument("--json", default=None, help="write the report here")
        g.add_argument(
            "--worker", default=None, help=argparse.SUPPRESS
        )  # a rank's JSON path (torchrun child)
    args = ap.parse_args(argv)
    if args.what == "ep-child":
        ep_child(args)
        return
    if args.what in ("gpu", "gpu-child"):
        if args.smoke:
            for key, value in GPU_SMOKE.items():
                setattr(args, key, value)
            args.shape = "tiny"
        if args.warmup < 1 or args.steps < 1 or args.seq < 1 or args.rows < 1:
            ap.error("--warmup, --steps, --seq and --rows must be >= 1")
        if args.what == "gpu-child":
            gpu_child(args)
            return
        try:
            report = gpu_main(args, run)
        except ValueError as err:  # the run's refusals (ConfigError, ExpertParallelError): argparse's exit 2
            ap.error(str(err))
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(report, indent=1))
        return
    results = ep_main(args, run) if args.what == "ep" else kernels(args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
