"""Context and tensor parallel on GPUs: tokens/s and MFU of training steps at 8k, 32k and 128k tokens.

    python bench/gpu_bench_parallel.py --shape 1b --cp 2 --seq 8192,32768,131072 --out bench/out/cp2_1b.json
    python bench/gpu_bench_parallel.py --shape 8b --cp 4 --cp-backend ring --seq 131072 --ac full
    python bench/gpu_bench_parallel.py --shape 8b --tp 2 --cp 2 --procs 8 --seq 32768   # dp 2 x cp 2 x tp 2
    python bench/gpu_bench_parallel.py --dry-run --shape 8b --cp 8 --seq 131072        # any machine: the plan only
    python bench/gpu_bench_parallel.py --smoke --out /tmp/parallel.json                # any machine: CPU, gloo

The work: a random-init Llama of ``--shape`` (``1b``: Llama-3.2-1B, hidden 2048, 16 layers, 32 / 8 KV heads, tied;
``8b``: Llama-3-8B, hidden 4096, 32 layers, 32 / 8 KV heads, MLP 14336; ``tiny`` for ``--smoke``), sdpa, bf16 compute
over fp32 sharded weights, AdamW, trained by the library's own pieces as a recipe builds them: the mesh
(``resolve_mesh``: dp_shard x cp x tp = ``--procs``, default cp x tp: one data rank), tensor parallel
(the family's plan), context parallel (``--cp-backend`` all_to_all or ring), ``parallelize`` (activation
checkpointing ``--ac``, regional compile unless ``--eager``) and ``train_step`` (the chunked loss). Each data rank
trains one row of ``--seq`` tokens per step, one causal sequence (what both backends run: no packing).

Counted as hf_fsdp2's meter counts (:mod:`hf_fsdp2.observe.meter`): each rank charges its data rank's whole row,
``seq x (6N + 12 L H Q seq)`` (``T = seq``: the long sequence's attention counted at its full length, never the
part a rank holds), the sum over ranks is divided by ``cp x tp`` (a group's ranks counted the same row) and the
step's FLOPs are shared by the ``--procs`` devices: ``tflops_per_device = data ranks x row FLOPs / step_s / procs``;
MFU against the device's spec peak (``peak_flops_for``). tokens/s: every data rank's row per timed step. The clock
runs over ``--steps`` steps after ``--warmup`` (compile happens there), each end after a device synchronize; memory:
``max_memory_allocated``, the largest rank; ``collectives_per_step``: one more step's collectives on rank 0 by kind
(:class:`hf_fsdp2.observe.comms.CollectiveCounter`, eager), printed next to the seconds (docs/performance.md has
the per-layer counts of tensor parallel); with ``--optim muon`` also Muon's all-to-alls of that step
(``muon_all_to_alls_per_step``, 2 per bucket) and its owner rounds (``muon_rounds``: 2 all-to-alls each before
buckets). One ``torchrun`` per sequence length (a fresh process group and
allocator); a length that fails (OOM, a refusal) is reported with its error, the others still run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
# bench_launch lives beside this file (bench/ is not a package): importable also when a test loads this file by path.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_launch import free_port, run_child  # noqa: E402

SHAPES = {
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True},
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": True},
}  # fmt: skip
SMOKE = {"shape": "tiny", "seq": "256", "cp": 2, "tp": 1, "nproc": 2, "warmup": 1, "steps": 1, "cpu": True}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, ``--smoke`` applied, the mesh checked against the shape (argparse's error, exit 2)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--seq", default="8192,32768,131072", help="tokens per row, comma-separated lengths")
    ap.add_argument("--cp", type=int, default=1, help="context-parallel size")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    ap.add_argument("--cp-backend", choices=("all_to_all", "ring"), default="all_to_all")
    ap.add_argument("--procs", dest="nproc", type=int, default=None, help="processes (GPUs); default cp x tp")
    ap.add_argument("--ac", choices=("none", "full"), default="full", help="activation checkpointing")
    ap.add_argument(
        "--optim",
        choices=("adamw", "muon"),
        default="adamw",
        help="muon: Muon on the decoder matrices (its bucketed all-to-alls counted), AdamW on the rest",
    )
    ap.add_argument(
        "--eager", action="store_true", help="no torch.compile (default: regional compile on GPU)"
    )
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU, fp32 (what --smoke uses)")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny shape, seq 256, cp 2 on 2 CPU processes, 1+1 steps"
    )
    ap.add_argument("--dry-run", action="store_true", help="print the plan and launch lines; run nothing")
    ap.add_argument(
        "--timeout-s", type=float, default=900.0, help="one sequence length's torchrun is stopped after"
    )
    ap.add_argument("--out", default=None, help="write the JSON report here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a rank's JSON path (torchrun child)
    args = ap.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    args.nproc = args.nproc or args.cp * args.tp
    args.seqs = [int(s) for s in str(args.seq).split(",") if s]
    if args.warmup < 1 or args.steps < 1 or not args.seqs or min(args.seqs) < 1:
        ap.error("--warmup and --steps must be >= 1 and --seq a list of positive lengths")
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from hf_fsdp2.config.plans import ConfigError, check_mesh, resolve_mesh

    shape = SHAPES[args.shape]
    try:
        args.mesh = resolve_mesh(
            args.nproc, dp_replicate=None, dp_shard=None, tp=args.tp, cp=args.cp, cp_backend=args.cp_backend
        )
        check_mesh(
            args.mesh,
            heads=shape["num_attention_heads"],
            kv_heads=shape["num_key_value_heads"],
            max_length=max(args.seqs),
        )
    except ConfigError as err:
        ap.error(str(err))
    if args.cp_backend == "ring" and args.cp > 1 and args.cpu:
        from hf_fsdp2.parallel.ring import RING_CPU_REFUSAL

        ap.error(RING_CPU_REFUSAL)
    return args


def flops_model(shape: str) -> Any:
    """The meter's FLOPs model of ``shape`` (built on the meta device: no memory)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_fsdp2.observe.flops import flops_model as model_flops
    from hf_fsdp2.observe.flops import non_embedding_params

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape]))
    return model_flops(model.config, non_embedding_params(model))


def per_device_flops(flops: Any, seq: int, *, nproc: int, cp: int, tp: int) -> float:
    """FLOPs per device of one step as the meter charges it: every rank counts its data rank's whole row, the sum
    over ranks is divided by ``cp x tp``, the result shared by ``--procs`` devices."""
    counted = nproc * flops.for_sequences([seq])  # each rank: the whole row of its data rank
    return counted / (cp * tp) / nproc


def launch_line(args: argparse.Namespace, seq: int, out: Path, port: int) -> list[str]:
    flags = [
        "--shape",
        args.shape,
        "--seq",
        str(seq),
        "--cp",
        str(args.cp),
        "--tp",
        str(args.tp),
        "--cp-backend",
        args.cp_backend,
        "--procs",
        str(args.nproc),
        "--ac",
        args.ac,
        "--optim",
        args.optim,
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
        "--worker",
        str(out),
    ]
    flags += ["--eager"] * args.eager + ["--cpu"] * args.cpu
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(args.nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
        str(Path(__file__).resolve()),
        *flags,
    ]


@contextlib.contextmanager
def logged_lines() -> Iterator[list[str]]:
    """The lines the library logs inside the block."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("hf_fsdp2")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)  # the lines are info lines, whatever this rank's logging setup shows
    try:
        yield lines
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def worker(args: argparse.Namespace) -> None:
    """One rank of one sequence length (under torchrun): build, train, time; rank 0 writes the JSON."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_fsdp2 import collectives
    from hf_fsdp2.config.plans import ACPlan, CompilePlan, ShardingPlan
    from hf_fsdp2.observe.comms import CollectiveCounter
    from hf_fsdp2.observe.flops import peak_flops_for
    from hf_fsdp2.parallel.accelerator import build_accelerator
    from hf_fsdp2.parallel.parallelize import ContextParallel, ParallelPlan, TensorParallel, parallelize
    from hf_fsdp2.parallel.tensor import tp_plan_for
    from hf_fsdp2.train.loss import plan_loss
    from hf_fsdp2.train.muon import MuonSettings, build_muon_adamw
    from hf_fsdp2.train.muon_exchange import owner_rounds
    from hf_fsdp2.train.optim import build_adamw, param_groups
    from hf_fsdp2.train.step import StepSettings, train_step

    seq, gpu = args.seqs[0], not args.cpu
    result: dict[str, Any] = {"seq": seq}
    try:
        sharding = ShardingPlan(activation_checkpointing=ACPlan(args.ac, pin_memory=gpu))
        compile_plan = CompilePlan(enabled=gpu and not args.eager, scope="regional")
        acc = build_accelerator(
            sharding,
            mixed_precision="bf16" if gpu else "no",
            compile_plan=compile_plan,
            force_cpu=not gpu,
            mesh=args.mesh,
        )
        device = acc.device
        torch.manual_seed(0)
        config = LlamaConfig(
            **SHAPES[args.shape], max_position_embeddings=max(seq, 8192), rope_theta=500000.0
        )
        config._attn_implementation = "sdpa"
        with torch.device(device):
            model = LlamaForCausalLM(config)
        model.config.use_cache = False
        flops = flops_model(args.shape)
        tp = TensorParallel(acc.torch_device_mesh["tp"], tp_plan_for(model)) if args.tp > 1 else None
        cp = (
            ContextParallel(collectives.cp_group(), args.cp, args.cp_backend, args.tp)
            if args.cp > 1
            else None
        )
        plan = ParallelPlan(
            layer_cls=("LlamaDecoderLayer",), tp=tp, cp=cp, ac=sharding.ac, compile=compile_plan
        )
        with logged_lines() as lines:  # the tp / cp lines parallelize logs, for the result
            model = parallelize(model, acc, plan)
        for line in lines:
            for key, start in (("tp", "tensor parallel"), ("cp", "context parallel")):
                if line.startswith(start):
                    result[key] = line
        if args.optim == "muon":
            muon = MuonSettings(lr=1e-4, adjust_lr="match_rms_adamw", weight_decay=0.0)
            opt, split = build_muon_adamw(
                model,
                ("LlamaDecoderLayer",),
                muon,
                lr=1e-4,
                betas=(0.9, 0.95),
                eps=1e-8,
                device_type=device.type,
            )
            shapes = [(int(p.shape[0]), int(p.shape[1])) for _, p in split.muon]
            result["muon_rounds"] = len(owner_rounds(shapes, args.nproc // args.tp))
        else:
            opt = build_adamw(
                param_groups(model, 0.0), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, device_type=device.type
            )
        settings = StepSettings(plan_loss(model, 4096), max_grad_norm=1.0)
        gen = torch.Generator().manual_seed(1000 * collectives.data_rank())  # each data rank its own rows
        rows = [
            torch.randint(0, config.vocab_size, (1, seq), generator=gen)
            for _ in range(args.warmup + args.steps + 1)
        ]
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        losses: list[float] = []

        def step(ids: torch.Tensor) -> Any:
            return train_step(model, opt, None, [{"input_ids": ids, "labels": ids.clone()}], settings, device)

        outs = [step(ids) for ids in rows[: args.warmup]]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        outs += [step(ids) for ids in rows[args.warmup : -1]]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        # One more step, untimed and eager, with its collectives counted (FSDP2's, tensor and context parallel's,
        # the step's own reductions): compiled layers issue the same ones.
        with torch.compiler.set_stance("force_eager"), CollectiveCounter() as counter:
            step(rows[-1])
        result["collectives_per_step"] = counter.counts()
        if args.optim == "muon":  # of them, Muon's: 2 per bucket of owner rounds (2 per round before buckets)
            result["muon_all_to_alls_per_step"] = opt.last_collectives
        for out in outs:  # read after the clock: a read waits for the device
            total = collectives.all_reduce_sum(out.loss_sum.detach().float().reshape(1))
            losses.append(float(total) / collectives.tp_size() / max(out.target_tokens, 1))
        data_ranks = args.nproc // (args.cp * args.tp)
        step_s = seconds / args.steps
        per_device = per_device_flops(flops, seq, nproc=args.nproc, cp=args.cp, tp=args.tp)
        peak = peak_flops_for(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
        result.update(
            {
                "tokens_per_s": data_ranks * seq / step_s,
                "step_s": step_s,
                "tflops_per_device": per_device / step_s / 1e12,
                "mfu": per_device / step_s / peak if peak else None,
                "losses": losses,
                "max_mem_allocated_gib": collectives.all_reduce_max([memory])[0] if gpu else None,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            }
        )
    except Exception as err:  # noqa: BLE001  # reported for this length; the others still run
        result["error"] = f"{type(err).__name__}: {err}"[:2000]
        result["traceback"] = traceback.format_exc()[-3000:]
    if collectives.rank() == 0:
        Path(args.worker).write_text(json.dumps(result))


def main(argv: list[str] | None = None, run: Callable[..., Any] = subprocess.run) -> None:
    """The command line (``argv``, default sys.argv); each length's torchrun is ``run(command, env=, capture_output=True,
    text=True, timeout=)`` (subprocess.run; the tests fork the same command line from a pre-imported interpreter)."""
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    flops = flops_model(args.shape)
    plan = {
        "shape": args.shape,
        "nproc": args.nproc,
        "mesh": args.mesh.describe(),
        "cp_backend": args.cp_backend,
        "ac": args.ac,
        "compile": "eager" if args.eager or args.cpu else "regional",
        "results": [],
    }
    work = Path(tempfile.mkdtemp(prefix="gpu_bench_parallel-"))
    for seq in args.seqs:
        out = work / f"seq{seq}.json"
        cmd = launch_line(args, seq, out, free_port())
        entry: dict[str, Any] = {
            "seq": seq,
            "launch": " ".join(cmd[1:]),
            "tflop_per_device_per_step": per_device_flops(
                flops, seq, nproc=args.nproc, cp=args.cp, tp=args.tp
            )
            / 1e12,
        }
        if not args.dry_run:
            entry.update(run_child(run, cmd, out, args.timeout_s))
        plan["results"].append(entry)
        keys = (
            ("seq", "tflop_per_device_per_step", "launch")
            if args.dry_run
            else (
                "seq",
                "tokens_per_s",
                "mfu",
                "step_s",
                "collectives_per_step",
                "muon_all_to_alls_per_step",
                "error",
            )
        )
        shown = {k: v for k, v in entry.items() if k in keys}
        print(json.dumps(shown), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(plan, indent=1))


if __name__ == "__main__":
    main()
