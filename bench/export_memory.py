"""Peak host memory per rank while exporting: hf_fsdp2's gather-free export vs accelerate's full gather.

    python bench/export_memory.py --out /tmp/export-bench            # builds models, runs every case
    python bench/export_memory.py --out /tmp/export-bench --sizes 470m --world 2

For each model size and method, a fresh ``torchrun --nproc_per_node WORLD`` run: every rank builds the
FSDP2-sharded model through the recipe's own path (rank 0 reads the weights, the others start on meta
and receive their shards), frees what loading left behind, then a sampler thread records the
process's resident set size (RSS, plus its child processes) every 5 ms while the export runs.
Reported per rank: RSS before the export, peak RSS during it, and the peak increase, next to the
model's size. Methods:

* ``gather_free``         ``hf_fsdp2.export.export_model`` (verify off): the write path alone;
* ``gather_free_verified`` the same with verification on (rank 0's reload runs in a child process,
                           whose RSS is counted in rank 0's);
* ``accelerate_gather``   ``Accelerator.save_model``: ``get_state_dict`` gathers the full state dict on
                           rank 0's CPU, which then writes it.

Both write float32 (the master weights, what ``save_model`` writes) unless ``--dtype`` says otherwise.
Prints one JSON line per (size, method) and a Markdown table at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

SIZES = {
    # name: (hidden, layers, intermediate, heads, kv heads, vocab)
    "120m": (768, 12, 2048, 12, 4, 32000),
    "470m": (1024, 24, 4096, 16, 8, 32000),
}


def build_model_dir(path: Path, size: str) -> Path:
    """A random-init Llama saved in float32 with a real tokenizer (the tests' Llama-2 tokenizer)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import CHATML_SPECIAL_TOKENS, CHATML_TEMPLATE, build_llama2_test_tokenizer

    if (path / "config.json").is_file():
        return path
    hidden, layers, inter, heads, kv, _ = SIZES[size]
    tokenizer = build_llama2_test_tokenizer(CHATML_TEMPLATE, CHATML_SPECIAL_TOKENS)
    tokenizer.pad_token = tokenizer.eos_token
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class RssSampler:
    """Peak memory of this process and its children, sampled every few milliseconds in a thread.

    ``peak`` is the resident set size (RSS); ``peak_anon`` leaves out file-backed pages (RSS minus
    Linux's "shared" resident pages: mapped files such as safetensors read with mmap), which the
    kernel can drop at any time; the heap, tensors and buffers are anonymous memory.
    """

    def __init__(self, interval_s: float = 0.005) -> None:
        import psutil

        self.proc = psutil.Process()
        self.interval_s = interval_s
        self.peak = self.peak_anon = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> tuple[int, int]:
        import psutil

        rss = anon = 0
        for p in [self.proc, *self.proc.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                info = p.memory_info()
                rss += info.rss
                anon += info.rss - getattr(info, "shared", 0)
        return rss, anon

    def _update(self) -> None:
        rss, anon = self.sample()
        self.peak, self.peak_anon = max(self.peak, rss), max(self.peak_anon, anon)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._update()
            time.sleep(self.interval_s)

    def __enter__(self) -> RssSampler:
        self.before, self.before_anon = self.sample()
        self.peak, self.peak_anon = self.before, self.before_anon
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._update()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def release_freed_memory() -> None:
    """Return memory freed by loading to the OS, so the baseline is what the process really holds."""
    gc.collect()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def worker(args: argparse.Namespace) -> None:
    """One rank of one case (under torchrun)."""
    import torch
    import torch.distributed as dist

    from hf_fsdp2.config import parse_size
    from hf_fsdp2.config.plans import CompilePlan, ShardingPlan
    from hf_fsdp2.export import export_model
    from hf_fsdp2.model import decoder_layer_classes, load_model, load_tokenizer
    from hf_fsdp2.parallel.accelerator import build_accelerator
    from hf_fsdp2.parallel.parallelize import ParallelPlan, parallelize
    from hf_fsdp2.train.optim import build_adamw, param_groups

    acc = build_accelerator(
        ShardingPlan(cpu_ram_efficient_loading=True), mixed_precision="bf16", compile_plan=CompilePlan()
    )
    rank = acc.process_index
    model = load_model(args.model, empty_weights=rank != 0)
    n_params = sum(p.numel() for p in model.parameters())
    tokenizer = load_tokenizer(args.model)
    model = parallelize(model, acc, ParallelPlan(layer_cls=decoder_layer_classes(model)))
    opt = build_adamw(param_groups(model, 0.0), lr=1e-5, betas=(0.9, 0.999), eps=1e-8, device_type="cpu")
    # One training step first, so that the export runs as at the end of training (FSDP2 initialised,
    # optimizer state allocated), not right after loading.
    ids = torch.randint(3, 1000, (1, 64), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    out = Path(args.out_case)
    release_freed_memory()
    dist.barrier()
    start = time.perf_counter()
    with RssSampler() as sampler:
        if args.method.startswith("gather_free"):
            unwrapped = acc.unwrap_model(model)
            export_model(
                model,
                out,
                config=unwrapped.config,
                tokenizer=tokenizer,
                generation_config=None,
                dtype=args.dtype,
                max_shard_bytes=parse_size(args.max_shard_size),
                verify=args.method == "gather_free_verified",
                compute_dtype=torch.bfloat16,
            )
        else:
            acc.save_model(model, out, max_shard_size=args.max_shard_size)
        dist.barrier()
    seconds = time.perf_counter() - start
    weights = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    row = {
        "rank": rank,
        "world": acc.num_processes,
        "method": args.method,
        "params": n_params,
        "weights_bytes": weights,
        "rss_before": sampler.before,
        "rss_peak": sampler.peak,
        "rss_increase": sampler.peak - sampler.before,
        "anon_increase": sampler.peak_anon - sampler.before_anon,
        "seconds": seconds,
        "max_shard": args.max_shard_size,
    }
    Path(args.report).with_suffix(f".rank{rank}.json").write_text(json.dumps(row))
    acc.end_training()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/hf_fsdp2-export-bench"))
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument(
        "--methods", nargs="+", default=["gather_free", "gather_free_verified", "accelerate_gather"]
    )
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max_shard_size", default="2GB", help="largest output file (both methods)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out_case", help=argparse.SUPPRESS)
    ap.add_argument("--report", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    rows = []
    for size in args.sizes:
        model = build_model_dir(args.out / f"model-{size}", size)
        for method in args.methods:
            case = args.out / f"{size}-{method}"
            report = args.out / f"{size}-{method}.json"
            env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                str(args.world),
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(free_port()),
                __file__,
                "--worker",
                "--method",
                method,
                "--model",
                str(model),
                "--out_case",
                str(case),
                "--report",
                str(report),
                "--dtype",
                args.dtype,
                "--max_shard_size",
                args.max_shard_size,
            ]
            subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
            for r in range(args.world):
                row = json.loads(report.with_suffix(f".rank{r}.json").read_text()) | {"size": size}
                print(json.dumps(row), flush=True)
                rows.append(row)
            subprocess.run(["rm", "-rf", str(case)], check=True)
    mib = 2**20
    head = "| model | written | world | method | rank | RSS before | peak RSS | RSS increase | anon increase | time |"
    print("\n" + head + "\n" + "|---" * 10 + "|")
    for r in rows:
        cells = [
            f"{r['size']} ({r['params'] / 1e6:.0f}M)",
            f"{r['weights_bytes'] / mib:.0f} MiB",
            r["world"],
            r["method"],
            r["rank"],
            f"{r['rss_before'] / mib:.0f} MiB",
            f"{r['rss_peak'] / mib:.0f} MiB",
            f"{r['rss_increase'] / mib:.0f} MiB",
            f"{r['anon_increase'] / mib:.0f} MiB",
            f"{r['seconds']:.1f}s",
        ]
        print("| " + " | ".join(map(str, cells)) + " |")


if __name__ == "__main__":
    main()
