"""Deterministic memory figures on CPU: activation memory per activation-checkpointing mode and per
loss path, the speed each mode costs, and parameter/gradient/optimizer bytes per rank vs world size.

    python bench/memory_bench.py                    # all three parts; table + JSON in bench/out/
    python bench/memory_bench.py --part activations --seq 1024 --batch 2
    python bench/memory_bench.py --part sharding --worlds 1,2,4

Activations (one process, no sharding): a random-init Llama of the SmolLM2-135M shape (hidden 576,
30 layers, vocab 49152) by default. For each mode, ``hf_fsdp2.parallel.activations.activation_bytes`` counts
the bytes the forward leaves alive for backward: every storage created during the forward, weakly
referenced, still alive when it returns (parameters excluded). It does not depend on an allocator, so
the figure is exact and repeatable on CPU; it is the activation memory a GPU would hold too (same ops,
same tensors). The loss is hf_fsdp2's chunked cross entropy unless ``--loss plain``; a separate table
compares the two loss paths with no checkpointing. Speed: forward+backward wall time per mode,
alternating modes over ``--repeats`` rounds, medians, and the ratio to ``none``.

Sharding (torchrun on gloo, one process per rank): the same model through ``parallelize`` at each
world size, one AdamW step, then each rank sums the bytes it holds locally: parameter shards, gradient
shards, optimizer state (exp_avg, exp_avg_sq, step). The maximum over ranks is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
MODES = ("none", "full", "every_k", "selective")
MIB = 2**20


def build_model(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(2048, args.seq),
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.config.use_cache = False
    return model


def loss_fn(model: Any, ids: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    from hf_fsdp2.train.loss import LossPlan, causal_lm_loss_sum

    labels = ids.clone()
    return (
        causal_lm_loss_sum(model, {"input_ids": ids}, labels, LossPlan(chunk_tokens)) / labels[:, 1:].numel()
    )


def activations(args: argparse.Namespace) -> dict[str, Any]:
    from hf_fsdp2.config.plans import ACPlan
    from hf_fsdp2.parallel.activations import activation_bytes, apply_activation_checkpointing

    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    chunk = 1024 if args.loss == "chunked" else 0
    models = {}
    for mode in MODES:
        model = build_model(args)
        apply_activation_checkpointing(model, ACPlan(mode, every_k=args.every_k), ("LlamaDecoderLayer",))
        models[mode] = model
    kept = {mode: activation_bytes(m, lambda m=m: loss_fn(m, ids, chunk)) for mode, m in models.items()}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode, model in models.items():  # alternate the modes
            start = time.perf_counter()
            loss_fn(model, ids, chunk).backward()
            times[mode].append(time.perf_counter() - start)
            for p in model.parameters():
                p.grad = None
    median = {mode: statistics.median(t) for mode, t in times.items()}
    rows = {
        mode: {
            "activation_mib": kept[mode] / MIB,
            "vs_none": kept[mode] / kept["none"],
            "step_s": median[mode],
            "time_vs_none": median[mode] / median["none"],
        }
        for mode in MODES
    }
    # The loss path, no checkpointing: the plain path keeps [tokens x vocab] fp32 logits for backward.
    plain_model = models["none"]
    loss_rows = {}
    for name, tokens in (("plain", 0), ("chunked_1024", 1024)):
        loss_rows[name] = activation_bytes(plain_model, lambda t=tokens: loss_fn(plain_model, ids, t)) / MIB
    return {"modes": rows, "loss_paths_mib": loss_rows, "tokens": ids.numel(), "loss": args.loss}


def sharding_worker(args: argparse.Namespace) -> None:
    """One rank of the sharding measurement (under torchrun)."""
    from torch.distributed.tensor import DTensor

    from hf_fsdp2.config.plans import CompilePlan, ShardingPlan
    from hf_fsdp2.parallel.accelerator import build_accelerator
    from hf_fsdp2.parallel.parallelize import ParallelPlan, parallelize
    from hf_fsdp2.train.optim import build_adamw, param_groups

    acc = build_accelerator(ShardingPlan(), mixed_precision="no", compile_plan=CompilePlan())
    model = build_model(args)
    total = sum(p.numel() for p in model.parameters())
    model = parallelize(model, acc, ParallelPlan(layer_cls=("LlamaDecoderLayer",)))
    opt = build_adamw(param_groups(model, 0.0), lr=1e-4, betas=(0.9, 0.999), eps=1e-8, device_type="cpu")
    ids = torch.randint(0, args.vocab, (1, 32), generator=torch.Generator().manual_seed(acc.process_index))
    loss_fn(model, ids, 1024).backward()
    opt.step()

    def local(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    held = {
        "params": sum(local(p) for p in model.parameters()),
        "grads": sum(local(p.grad) for p in model.parameters() if p.grad is not None),
        "optimizer": sum(
            local(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
        ),
    }
    table = torch.tensor([held["params"], held["grads"], held["optimizer"]], dtype=torch.float64)
    gathered = [torch.zeros_like(table) for _ in range(acc.num_processes)]
    torch.distributed.all_gather(gathered, table)
    if acc.is_main_process:
        peak = torch.stack(gathered).max(dim=0).values.tolist()
        Path(args.worker_out).write_text(
            json.dumps({"params": peak[0], "grads": peak[1], "optimizer": peak[2], "model_params": total})
        )
    acc.end_training()


def sharding(
    args: argparse.Namespace, work: Path, run: Callable[..., Any] = subprocess.run
) -> dict[str, Any]:
    """Each world size's torchrun, started by ``run`` (subprocess.run; the tests fork the same command line)."""
    rows = {}
    for world in [int(w) for w in args.worlds.split(",")]:
        out = work / f"sharding_{world}.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(world),
            "--master_port",
            str(29600 + world),
            __file__,
            "--worker",
            "sharding",
            "--worker-out",
            str(out),
            *model_flags(args),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        proc = run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"world {world} failed:\n{proc.stderr[-4000:]}")
        r = json.loads(out.read_text())
        per_rank = r["params"] + r["grads"] + r["optimizer"]
        rows[world] = {
            "params_mib": r["params"] / MIB,
            "grads_mib": r["grads"] / MIB,
            "optimizer_mib": r["optimizer"] / MIB,
            "total_mib": per_rank / MIB,
            "bytes_per_param": per_rank / r["model_params"],
        }
    first = rows[min(rows)]["total_mib"]
    for row in rows.values():
        row["vs_world_1"] = row["total_mib"] / first
    return rows


def model_flags(args: argparse.Namespace) -> list[str]:
    return [
        "--vocab",
        str(args.vocab),
        "--hidden",
        str(args.hidden),
        "--intermediate",
        str(args.intermediate),
        "--layers",
        str(args.layers),
        "--heads",
        str(args.heads),
        "--kv-heads",
        str(args.kv_heads),
        "--seq",
        str(args.seq),
    ]


def main(argv: list[str] | None = None, run: Callable[..., Any] = subprocess.run) -> None:
    """The command line (``argv``, default sys.argv); ``run`` starts the sharding part's torchrun (:func:`sharding`)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("all", "activations", "sharding"), default="all")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--every-k", type=int, default=2)
    ap.add_argument("--loss", choices=("chunked", "plain"), default="chunked")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--work", default=str(REPO / "bench" / "out" / "memory_bench"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker == "sharding":
        sharding_worker(args)
        sys.stdout.flush()
        os._exit(0)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"args": vars(args)}
    print(
        f"model: Llama shape hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; fp32", flush=True
    )
    if args.part in ("all", "activations"):
        report["activations"] = act = activations(args)
        print(
            f"\nactivation memory, batch {args.batch} x seq {args.seq} ({act['tokens']} tokens), "
            f"{args.loss} loss; speed: median of {args.repeats} alternating forward+backward"
        )
        print(f"{'mode':10s} {'MiB kept':>10s} {'x none':>7s} {'step s':>8s} {'x none':>7s}")
        for mode, row in act["modes"].items():
            print(
                f"{mode:10s} {row['activation_mib']:10.1f} {row['vs_none']:7.2f} {row['step_s']:8.2f} "
                f"{row['time_vs_none']:7.2f}"
            )
        print(
            "loss path, no checkpointing: "
            + ", ".join(f"{k} {v:.1f} MiB" for k, v in act["loss_paths_mib"].items())
        )
    if args.part in ("all", "sharding"):
        report["sharding"] = rows = sharding(args, work, run)
        print("\nper rank after one AdamW step (fp32 params, grads, exp_avg + exp_avg_sq), max over ranks")
        print(
            f"{'world':>5s} {'params MiB':>11s} {'grads MiB':>10s} {'optim MiB':>10s} {'total MiB':>10s} "
            f"{'B/param':>8s} {'x world 1':>9s}"
        )
        for world, row in rows.items():
            print(
                f"{world:5d} {row['params_mib']:11.1f} {row['grads_mib']:10.1f} {row['optimizer_mib']:10.1f} "
                f"{row['total_mib']:10.1f} {row['bytes_per_param']:8.2f} {row['vs_world_1']:9.3f}"
            )
    (work / "results.json").write_text(json.dumps(report, indent=1, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
