"""One GPU (an H200), one command under 7 minutes: speed and memory of the performance switches.

    python bench/gpu_bench.py --json bench/out/gpu_bench.json          # on the GPU machine
    python bench/gpu_bench.py --cpu --shape small --seq 1024 --warmup 2 --steps 3 \
        --configs eager:none:chunked,regional:none:chunked,model:none:chunked   # compile scopes on CPU (fp32)
    python bench/gpu_bench.py --smoke                                  # any machine: tiny shape, CPU

A Llama-3.2-1B-shaped model (hidden 2048, 16 layers, 32 heads / 8 KV heads, MLP 8192, vocab 128256,
tied embeddings), random init, trained with AdamW on packed rows of ``--seq`` tokens (random documents
of random lengths, position_ids restarting per document, sdpa attention), through ``prepare_fsdp2``
(FSDP2 via Accelerate, world size 1), bf16 compute with fp32 master weights and fp32 reduction.
Configurations (``--configs``, each ``compile:ac:loss``): eager vs regional compile, activation
checkpointing none vs full, plain vs chunked cross entropy. Per configuration: compile time (the first
steps' time spent compiling, from dynamo's own timer), tokens/s over ``--steps`` timed steps after
``--warmup``, MFU against the H200's 989 TFLOP/s dense bf16 peak and against a bf16 matmul measured in
the same run, and the max memory allocated. Everything goes to stdout and, with ``--json``, to a file.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
H200_BF16_DENSE = 989e12
DEFAULT_CONFIGS = (
    "eager:none:plain,eager:none:chunked,eager:full:chunked,eager:offload:chunked,"
    "regional:none:plain,regional:none:chunked,regional:full:chunked"
)
SHAPES = {
    # Llama-3.2-1B
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256},
    # a CPU-sized model with a real vocabulary (SmolLM2's size)
    "small": {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 49152},
    "tiny": {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 4096},
}  # fmt: skip


def matmul_peak(device: torch.device, n: int) -> float:
    """Achieved bf16 matmul FLOP/s on an n x n x n product (the best of a few timed runs)."""
    if device.type != "cuda":
        return float("nan")
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            a @ b
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / 10)
    return 2 * n**3 / best


def packed_batch(args: argparse.Namespace, vocab: int, step: int) -> dict[str, torch.Tensor]:
    """One packed row: documents of random lengths back to back, position_ids restarting per document."""
    g = torch.Generator().manual_seed(step)
    lengths: list[int] = []
    while sum(lengths) < args.seq:
        # at most half a row per document: every row holds several (the same attention path every step)
        longest = max(65, min(2048, args.seq // 2))
        lengths.append(min(int(torch.randint(64, longest, (1,), generator=g)), args.seq - sum(lengths)))
    ids = torch.randint(0, vocab, (1, args.seq), generator=g)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    labels = ids.clone()
    labels[position_ids == 0] = -100  # no target across a document boundary
    return {"input_ids": ids, "position_ids": position_ids, "labels": labels}


def build(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = SHAPES[args.shape]
    config = LlamaConfig(**shape, max_position_embeddings=max(args.seq, 8192), rope_theta=500000.0,
                         tie_word_embeddings=True)  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)  # fp32 master weights; bf16 compute through the FSDP2 policy
    model.config.use_cache = False
    return model


def run_config(acc: Any, args: argparse.Namespace, item: str, peak_mm: float) -> dict[str, Any]:
    from hf_fsdp2.config.plans import ACPlan, CompilePlan, ShardingPlan
    from hf_fsdp2.observe.flops import flops_model, non_embedding_params
    from hf_fsdp2.parallel.accelerator import prepare_fsdp2
    from hf_fsdp2.parallel.compiling import CompileWatch
    from hf_fsdp2.train.loss import plan_loss
    from hf_fsdp2.train.optim import build_adamw, param_groups
    from hf_fsdp2.train.step import StepSettings, train_step

    scope, ac, loss_path = item.split(":")
    device = acc.device
    torch._dynamo.reset()
    model = build(args, device)
    flops = flops_model(model.config, non_embedding_params(model))
    opt = build_adamw(param_groups(model, 0.0), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, device_type=device.type)
    sharding = ShardingPlan(activation_checkpointing=ACPlan(ac, pin_memory=device.type == "cuda"))
    compile_plan = CompilePlan(enabled=scope != "eager", scope="regional" if scope == "eager" else scope)
    model, opt = prepare_fsdp2(
        acc, model, opt, ("LlamaDecoderLayer",), sharding=sharding, compile_plan=compile_plan
    )
    settings = StepSettings(plan_loss(model, 1024 if loss_path == "chunked" else 0), max_grad_norm=1.0)
    watch = CompileWatch(enabled=scope != "eager").start()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def step(i: int) -> None:  # the library's own step: the one every recipe runs
        train_step(model, opt, None, [packed_batch(args, model.config.vocab_size, i)], settings, device)

    start = time.perf_counter()
    for i in range(args.warmup):
        step(i)
    if device.type == "cuda":
        torch.cuda.synchronize()
    warmup_s = time.perf_counter() - start
    compiled = watch.take()
    start = time.perf_counter()
    for i in range(args.warmup, args.warmup + args.steps):
        step(i)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = args.steps * args.seq
    achieved = (
        flops.per_token(args.seq) * tokens / seconds
    )  # 6N + 12LHQT at T = seq (upper bound: packed docs are shorter)
    result = {
        "config": item,
        "tokens_per_s": tokens / seconds,
        "step_s": seconds / args.steps,
        "tflops": achieved / 1e12,
        "mfu_vs_989": achieved / H200_BF16_DENSE if device.type == "cuda" else None,
        "mfu_vs_measured_matmul": achieved / peak_mm if peak_mm == peak_mm else None,
        "max_mem_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30
        if device.type == "cuda"
        else None,
        "compile_s": compiled.get("compile_s", 0.0),
        # recompiles during the timed steps (their time is in step_s): should be 0
        "recompiles_timed": watch.take().get("recompiles", 0.0) - compiled.get("recompiles", 0.0),
        "recompiles_total": compiled.get("recompiles", 0.0),
        "warmup_s": warmup_s,
    }
    return result


def release(acc: Any) -> None:
    """Free a configuration's model and optimizer (accelerate keeps references to what it prepared)."""
    acc._models.clear()
    acc._optimizers.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=DEFAULT_CONFIGS)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--cpu", action="store_true", help="run on CPU (gloo) even with a GPU visible")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny shape on CPU, 1+1 steps: checks the script only"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.seq, args.warmup, args.steps, args.shape, args.cpu = min(args.seq, 256), 1, 1, "tiny", True
    sys.path.insert(0, str(REPO))
    from hf_fsdp2.config.plans import CompilePlan, ShardingPlan
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
    print(f"device {name}; measured bf16 matmul {peak_mm / 1e12:.0f} TFLOP/s; seq {args.seq}; "
          f"{args.warmup} warm-up + {args.steps} timed steps per configuration", flush=True)  # fmt: skip
    results = []
    for item in args.configs.split(","):
        start = time.perf_counter()
        try:
            r = run_config(acc, args, item, peak_mm)
        except torch.OutOfMemoryError as err:  # a configuration that does not fit is a result too
            r = {"config": item, "error": f"out of memory: {str(err)[:200]}"}
        release(acc)
        r["wall_s"] = time.perf_counter() - start
        results.append(r)
        print(json.dumps(r), flush=True)
    report = {"device": name, "matmul_tflops": peak_mm / 1e12, "seq": args.seq, "results": results}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    acc.end_training()


if __name__ == "__main__":
    main()
