"""One GPU (an H200), one command under 7 minutes: hf_fsdp2's performance switches beside TRL's SFTTrainer.

    python bench/gpu_bench.py --out bench/out/gpu_bench.json           # on the GPU machine
    python bench/gpu_bench.py --quick --out /tmp/gpu_quick.json        # ~1-2 min: eager vs regional, no TRL
    python bench/gpu_bench.py --cpu --shape small --seq 1024 --warmup 2 --steps 3 --trl none:none \
        --configs eager:none:chunked,regional:none:chunked,model:none:chunked   # compile scopes on CPU (fp32)
    python bench/gpu_bench.py --smoke --out /tmp/gpu_bench.json        # any machine: tiny shape, CPU

The work. A Llama-3.2-1B-shaped model (hidden 2048, 16 layers, 32 heads / 8 KV heads, MLP 8192, vocab
128256, tied embeddings), random init (seed 0, built on the run's device), trained with AdamW (lr 1e-4,
betas 0.9/0.95, no weight decay, constant lr, clipping at 1.0) on packed rows of ``--seq`` tokens: step
``i`` gets row ``i``, random documents of random lengths back to back (position_ids restarting per
document, no target across a document boundary), sdpa attention, bf16 compute with fp32 master weights,
one process, FSDP2 through Accelerate at world size 1.

Runners, in this order (TRL first: the baseline of every "x TRL"):

* ``trl <kernels>:<ac>`` (``--trl``, default ``none:none,liger:none``): ``trl.SFTTrainer`` launched the way
  TRL documents it, ``accelerate launch --config_file <trl>/accelerate_configs/fsdp2.yaml --num_processes 1
  --mixed_precision bf16 bench/gpu_bench.py --trl-child ...`` (TRL's own FSDP2 file: fsdp_version 2,
  transformer-based wrap, reshard after forward, cpu_ram_efficient_loading; one fresh process per runner).
  The model is the same random init saved once to a temporary folder (fp32 safetensors + a word-level
  tokenizer naming the pad and eos tokens: the data are token ids) and given to ``SFTTrainer`` as a path,
  loaded by TRL (fp32, ``attn_implementation="sdpa"``). The data: rows ``0..warmup+steps-1`` handed over
  packed, in the two columns TRL's packing produces (``input_ids``, ``seq_lengths``), with
  ``skip_prepare_dataset`` and ``train_sampling_strategy="sequential"``: TRL's step ``i`` trains on the
  very row of the hf_fsdp2 runners' step ``i``, collated by TRL's own padding-free collator (position_ids
  rebuilt from ``seq_lengths``). Left to pack the same documents itself (``packing_strategy="bfd"``), TRL
  makes 14 rows of the 13 at seq 4096, the last of 281 tokens: one step would then be mostly overhead.
  SFTConfig: ``packing=True``, ``packing_strategy="bfd"``, ``padding_free=True``, ``max_length=seq``,
  ``per_device_train_batch_size=1``, ``bf16=True`` (Accelerate's FSDP2 policy for bf16: parameters,
  gradient reduction and outputs in bf16 over fp32 sharded weights), ``gradient_checkpointing`` = ``<ac> == full`` (TRL's
  default is on; off is the faster setting when memory allows), ``use_liger_kernel`` = ``<kernels> ==
  liger`` (Liger's RMSNorm/RoPE/SwiGLU kernels; the loss stays TRL's fused LM head, which never builds
  the full logits), the optimizer settings above with TRL's default ``adamw_torch_fused``,
  ``logging_steps=1`` (the last step's loss; TRL reads its own metrics back every step anyway), no
  saving, no reporting; the JSON lists them all. Liger needs CUDA and
  ``liger-kernel``: without them the entry says why and has no numbers. TRL 1.16 marks
  ``use_liger_kernel`` deprecated for Hub kernels (``model_init_kwargs={"use_kernels": True}``), which
  are downloaded from the Hub: not measured here, nor flash-attention (TRL's advice for padding-free
  batches); every runner uses sdpa, to which transformers gives a block-diagonal mask from the
  position_ids.
* ``hf_fsdp2 <compile>:<ac>:<loss>`` (``--configs``): the library's own pieces in this process
  (``parallelize``, ``train_step``; bf16 compute, fp32 gradient reduction): eager vs regional compile,
  activation checkpointing none / full / offload, plain vs chunked cross entropy.

Measured per runner, over the ``--steps`` steps after ``--warmup`` (the clock runs from the end of step
``warmup`` to the end of the last step, each end after a device synchronize; TRL's from its
``on_step_end`` callback): tokens/s (non-pad tokens), target tokens/s, step time, achieved TFLOP/s and
MFU from the library's FLOP model (``6N + 12LHQT`` per token, ``T`` = each document's own length, the
same rows for every runner) against the device's spec peak (989 TFLOP/s for an H200) and against a
bf16 matmul measured once in this run (the same peak for every runner), ``torch.cuda.max_memory_allocated``
over the training steps, the loss of the last step; each hf_fsdp2 configuration also as "x TRL" (its
tokens/s over the best TRL runner's). TRL's token counts come from its own collated batches. On CPU
(``--cpu``, ``--smoke``) the TRL child is marked FSDP on gloo before the Trainer builds its Accelerator
(Accelerate keeps FSDP for GPUs): the same FSDP2 prepare path, checked (``fsdp2_sharded``) after training.

Time budget: ``--budget-s`` (default 400 s) for the runners, which leaves the interpreter's start and
the teardown inside 7 minutes. Planned from the FLOP model; the fixed costs (process starts, loading,
compile) are measured by the run itself, per runner as ``wall_s``:

* a step at seq 4096 is 3.2e13 to 3.4e13 FLOPs by the library's model (4096 tokens x (6 x 1.236e9 +
  attention over documents of 64 to 2047 tokens)); even at 10% of 989 TFLOP/s that is 0.34 s, so the
  3 + 10 steps of a runner take at most ~4.4 s: the budget goes to the fixed costs;
* per TRL runner: a fresh ``accelerate launch`` process (imports, CUDA and NCCL start), loading the
  4.9 GB fp32 folder (written once, by the first TRL runner) and the FSDP2 prepare;
* per hf_fsdp2 configuration: building the model on the GPU, and for regional compile the compile itself
  (reported as ``compile_s``; later configurations reuse Inductor's cache).

The script enforces the budget: a runner starts only while the time left exceeds the longest runner so
far; a TRL process is stopped after ``--trl-timeout-s`` (180 s) or at the deadline, whichever comes
first; what did not run says why, never with a number. ``--smoke`` runs every runner that can run on
CPU at a tiny size (2 layers, hidden 64, vocab 4096, seq 256, 1 + 1 steps, fp32) and lists the Liger
runner as skipped. On CPU the TRL process is given this process's torch thread count
(``--num_cpu_threads_per_process``; accelerate's GPU-style launch would give it one). Output: a table on
stdout and, with ``--out``, the JSON (every runner's entry, the device, the matmul and spec peaks, the
best TRL runner).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
# The pieces live beside this file, one concern each: gpu_bench_work (the model, rows and counting),
# gpu_bench_hf (an hf_fsdp2 runner), gpu_bench_trl (launching a TRL runner), gpu_bench_trl_child (the TRL
# runner in its own process), gpu_bench_report (ratios and table). bench/ is not a package: they import
# as top-level modules, also when this file is loaded by path (the tests).
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_bench_hf import release, run_config  # noqa: E402
from gpu_bench_report import add_ratios, print_table  # noqa: E402
from gpu_bench_trl import run_trl, save_model_folder, trl_unavailable  # noqa: E402
from gpu_bench_trl_child import trl_child  # noqa: E402
from gpu_bench_work import SHAPES, matmul_peak  # noqa: E402

DEFAULT_CONFIGS = (
    "eager:none:plain,eager:none:chunked,eager:full:chunked,eager:offload:chunked,"
    "regional:none:plain,regional:none:chunked,regional:full:chunked"
)
DEFAULT_TRL = "none:none,liger:none"
# --quick: the smallest run that still says something about the GPU path (one H200, ~1-2 min): the 1B
# shape at seq 4096, eager beside regional compile (chunked loss, no AC), 2 + 5 steps, no TRL runner.
# With FP8 hardware (sm_89+) the regional runner's FP8 twin too (torchao float8 decoder linears, float8 all-gather):
# a GPU without it lists the FP8 runner as skipped, with the reason.
QUICK = {
    "configs": "eager:none:chunked,regional:none:chunked,regional:none:chunked:fp8",
    "trl": "",
    "warmup": 2,
    "steps": 5,
    "budget_s": 150.0,
}
COMPILE_SCOPES, LOSS_PATHS, PRECISIONS = ("eager", "regional", "model"), ("plain", "chunked"), ("bf16", "fp8")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with ``--smoke`` / ``--quick`` applied and every runner spec checked.

    Raises:
        SystemExit: on a bad flag or runner spec (argparse's usage error, exit code 2).
    """
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--configs",
        default=DEFAULT_CONFIGS,
        help="hf_fsdp2 runners, compile:ac:loss[:bf16|fp8], comma-separated (fp8: mixed_precision fp8, torchao)",
    )
    ap.add_argument(
        "--fp8",
        action="store_true",
        help="add an fp8 twin after each bf16 hf_fsdp2 runner: bf16 vs FP8 tokens/s",
    )
    ap.add_argument(
        "--trl", default=DEFAULT_TRL, help="TRL runners, kernels:ac (none|liger : none|full); '' for none"
    )
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--cpu", action="store_true", help="run on CPU (gloo) even with a GPU visible")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny shape on CPU, 1+1 steps: checks the script only"
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"the smallest meaningful GPU run (~1-2 min): {QUICK} unless given explicitly",
    )
    ap.add_argument("--budget-s", type=float, default=400.0, help="wall-clock budget of the runners")
    ap.add_argument("--trl-timeout-s", type=float, default=180.0, help="a TRL runner is stopped after this")
    ap.add_argument(
        "--work", default=None, help="folder for the saved model and TRL's files (default: a temp dir)"
    )
    ap.add_argument("--out", default=None, help="write the JSON report here")
    ap.add_argument("--trl-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--trl-model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--trl-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from hf_fsdp2.config.plans import AC_MODES

    if args.quick:
        for key, value in QUICK.items():
            if getattr(args, key) == ap.get_default(key):  # a flag given explicitly wins
                setattr(args, key, value)
    if args.smoke:
        args.seq, args.warmup, args.steps, args.shape, args.cpu = min(args.seq, 256), 1, 1, "tiny", True
    if args.warmup < 1 or args.steps < 1:
        ap.error(
            "--warmup and --steps must be at least 1 (the clock starts at the end of the last warm-up step)"
        )
    bad_trl = [
        item
        for item in args.trl.split(",")
        if item
        and (
            len(item.split(":")) != 2
            or item.split(":")[0] not in ("none", "liger")
            or item.split(":")[1] not in ("none", "full")
        )
    ]
    if bad_trl:
        ap.error(f"--trl {bad_trl}: each TRL runner is kernels:ac, kernels none|liger, ac none|full")
    bad = [
        item
        for item in args.configs.split(",")
        if item
        and (
            len(item.split(":")) not in (3, 4)
            or item.split(":")[0] not in COMPILE_SCOPES
            or item.split(":")[1] not in AC_MODES
            or item.split(":")[2] not in LOSS_PATHS
            or (item.split(":") + ["bf16"])[3] not in PRECISIONS
        )
    ]
    if bad:
        ap.error(
            f"--configs {bad}: each hf_fsdp2 runner is compile:ac:loss[:precision], compile "
            f"{'|'.join(COMPILE_SCOPES)}, ac {'|'.join(AC_MODES)}, loss {'|'.join(LOSS_PATHS)}, precision "
            f"{'|'.join(PRECISIONS)} (default bf16)"
        )
    if args.fp8:  # each bf16 runner, then its FP8 twin (an fp8 runner given as such stays)
        bases = [i.removesuffix(":bf16") for i in args.configs.split(",") if i]
        args.configs = ",".join(
            dict.fromkeys(x for i in bases for x in ([i] if i.endswith(":fp8") else [i, f"{i}:fp8"]))
        )
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.trl_child:
        trl_child(args)
        sys.stdout.flush()
        os._exit(0)  # no interpreter finalization after a distributed run
    started = time.perf_counter()
    deadline = started + args.budget_s
    from hf_fsdp2.config.plans import CompilePlan, ShardingPlan
    from hf_fsdp2.observe.flops import peak_flops_for
    from hf_fsdp2.parallel.accelerator import build_accelerator

    acc = build_accelerator(
        ShardingPlan(),
        mixed_precision="no" if args.cpu else "bf16",
        compile_plan=CompilePlan(),
        force_cpu=args.cpu,
    )
    device = acc.device
    if device.type != "cuda" and not args.cpu:
        sys.exit(
            "no GPU visible: add --cpu (e.g. --cpu --shape small --seq 1024), or --smoke to check the script"
        )
    peak_mm = matmul_peak(device, 8192)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    spec = peak_flops_for(name) if device.type == "cuda" else None
    print(
        f"device {name}; measured bf16 matmul {peak_mm / 1e12:.0f} TFLOP/s; seq {args.seq}; "
        f"{args.warmup} warm-up + {args.steps} timed steps per runner; budget {args.budget_s:.0f} s",
        flush=True,
    )
    runners = [("trl", item) for item in args.trl.split(",") if item]
    runners += [("hf_fsdp2", item) for item in args.configs.split(",") if item]
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    folder = work / "model"
    results: list[dict[str, Any]] = []
    longest = 0.0
    for runner, item in runners:
        entry: dict[str, Any] = {"runner": runner, "config": item, "name": f"{runner} {item}"}
        results.append(entry)
        start = time.perf_counter()
        left = deadline - start
        if runner == "trl":
            reason = trl_unavailable(item.split(":")[0], device.type == "cuda")
            if reason:
                entry["skipped"] = reason
                print(json.dumps(entry), flush=True)
                continue
        if left < max(longest, 1.0):
            entry["skipped"] = (
                f"time budget: {left:.0f} s left, the longest runner so far took {longest:.0f} s"
            )
            print(json.dumps(entry), flush=True)
            continue
        if runner == "trl":
            if not folder.exists():
                save_model_folder(args, device, folder)
            timeout = min(args.trl_timeout_s, deadline - time.perf_counter())
            entry.update(run_trl(args, item, folder, work, timeout))
        else:
            try:
                entry.update(run_config(acc, args, item))
            except torch.OutOfMemoryError as err:  # a configuration that does not fit is a result too
                entry["error"] = f"out of memory: {str(err)[:200]}"
            release(acc)
        if "tokens_per_s" in entry:
            entry["mfu_vs_spec"] = entry["tflops"] * 1e12 / spec if spec else None
            entry["mfu_vs_measured_matmul"] = entry["tflops"] * 1e12 / peak_mm if peak_mm == peak_mm else None
        entry["wall_s"] = time.perf_counter() - start
        longest = max(longest, entry["wall_s"])
        print(json.dumps(entry), flush=True)
    report = {
        "device": name,
        "matmul_tflops": peak_mm / 1e12,
        "spec_tflops": spec / 1e12 if spec else None,
        "seq": args.seq,
        "shape": args.shape,
        "warmup": args.warmup,
        "steps": args.steps,
        "budget_s": args.budget_s,
        "torch_threads": torch.get_num_threads(),
        "trl_baseline": add_ratios(results),
        "results": results,
    }
    shutil.rmtree(folder if args.work else work, ignore_errors=True)
    report["wall_s"] = time.perf_counter() - started
    print_table(report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    acc.end_training()


if __name__ == "__main__":
    main()
