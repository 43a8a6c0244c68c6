"""Context parallel: activation bytes per rank against cp_size at a fixed sequence (CPU, gloo), and tokens/s.

    python bench/cp_bench.py                          # cp 1, 2, 4 at 8,192 tokens; table + JSON in bench/out/
    python bench/cp_bench.py --seq 4096 --cps 1,2 --packed

For each ``cp_size`` the script launches ``cp_size`` gloo processes (torchrun); each holds the same random-init
Llama (SmolLM2-135M's layer shape, fewer layers: ``--layers``), unsharded (activation bytes do not depend on how the
parameters are sharded), with context parallel over all of them (cp_size 1: the model as it is). One row of
``--seq`` tokens (``--packed``: several documents) is cut into parts (``shard_sequence``) and
``hf_fsdp2.parallel.activations.activation_bytes`` counts what the forward leaves alive for backward on each rank
(every storage created during the forward, weakly referenced, parameters excluded: exact and allocator-free, the
bytes a GPU would hold for the same ops). Expect ~1/cp of cp 1's: the layers' activations scale with the part; the
attention of the whole sequence is computed for heads/cp heads, its saved output and the all-to-all buffers too.
Time: forward + backward per step, median of ``--repeats``, and tokens/s over the group (noisy on a shared CPU:
compare within one run).

On GPUs the same script reports the same figures with ``--device cuda`` (one GPU per rank, NCCL) for Llama-3.2-1B
(``--hidden 2048 --heads 32 --kv-heads 8 --intermediate 8192 --layers 16``) or 8B shapes at 8k/32k/128k tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20


def _rank(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_fsdp2.parallel.activations import activation_bytes
    from hf_fsdp2.parallel.all_to_all import enable_context_parallel, shard_sequence
    from hf_fsdp2.train.loss import LossPlan, causal_lm_loss

    device = torch.device(args.device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    if device.type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.seq, 2048),
    )
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=dtype).to(device)
    line = enable_context_parallel(model, dist.group.WORLD, cp) if cp > 1 else "cp 1: the model as it is"
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (1, args.seq), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if args.packed:  # documents of 1/8 of the row each
        doc = args.seq // 8
        batch["position_ids"] = (torch.arange(args.seq) % doc)[None]
    part = (
        shard_sequence(batch, cp, rank) if cp > 1 else {**batch, "position_ids": torch.arange(args.seq)[None]}
    )
    if cp == 1 and args.packed:
        part["position_ids"] = batch["position_ids"]
    part = {k: v.to(device) for k, v in part.items()}
    inputs = {k: v for k, v in part.items() if k != "labels"}
    plan = LossPlan(chunk_tokens=args.ce_chunk)

    def forward() -> torch.Tensor:
        return causal_lm_loss(model, inputs, part["labels"], plan).ce_sum

    saved = activation_bytes(model, forward)
    times = []
    for _ in range(args.repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        forward().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    rows: list = [None] * cp
    dist.all_gather_object(rows, {"rank": rank, "saved": saved, "step_s": statistics.median(times)})
    if rank == 0:
        print(json.dumps({"cp": cp, "line": line, "ranks": rows}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--cps", default="1,2,4")
    parser.add_argument("--packed", action="store_true")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--heads", type=int, default=8)  # SmolLM2-135M has 9: not divisible by 2 or 4
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ce-chunk", type=int, default=256, help="ce_chunk_tokens of the chunked loss")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        _rank(args)
        return
    results = []
    for cp in (int(c) for c in args.cps.split(",")):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(cp),
            "--master_port",
            str(29500 + cp),
            __file__,
            "--rank",
            *sys.argv[1:],
        ]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
        found = [line for line in proc.stdout.splitlines() if line.startswith('{"cp"')]
        if proc.returncode or not found:
            raise SystemExit(f"cp {cp} failed:\n{proc.stderr[-3000:]}")
        results.append(json.loads(found[0]))
    base = max(r["saved"] for r in results[0]["ranks"])
    print(
        f"\nactivation bytes per rank, one row of {args.seq} tokens{' (packed, 8 documents)' if args.packed else ''}, "
        f"{args.layers} layers x hidden {args.hidden}, heads {args.heads}/{args.kv_heads}\n"
    )
    print(
        "| cp_size | tokens per rank | activation MiB per rank (max) | vs cp 1 | step s (median) | tokens/s |"
    )
    print("|---|---|---|---|---|---|")
    for r in results:
        saved = max(x["saved"] for x in r["ranks"])
        step = max(x["step_s"] for x in r["ranks"])
        print(
            f"| {r['cp']} | {-(-args.seq // r['cp'])} | {saved / MIB:.1f} | {saved / base:.3f} | {step:.2f} | "
            f"{args.seq / step:.0f} |"
        )
    out = REPO / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "cp_bench.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
