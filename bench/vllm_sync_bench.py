"""Seconds per GRPO weight update to a vLLM server, with what each update moves, on CPU (gloo) or GPUs (NCCL).

    python bench/vllm_sync_bench.py --cpu --shape smol --procs 2 --out /tmp/sync.json   # this machine: SmolLM2-135M shape
    python bench/vllm_sync_bench.py --shape 8b --procs 4                                  # 5 GPUs: 4 trainer ranks + the server's
    python bench/vllm_sync_bench.py --shape 8b --procs 1 --no-server                      # one GPU: the gathers alone

The work: ``--procs`` trainer ranks (torchrun) hold a random-init Llama of ``--shape`` sharded with FSDP2 (one unit per
decoder layer, the untied embeddings and head, the root), fp32 master weights; a receiver process runs the server's own code
(hf_fsdp2/methods/grpo/vllm/server.py: its HTTP handler, ``Engine`` and worker functions) over a stand-in engine
whose one worker copies every tensor it receives into its own weights (vLLM's in-place reload, without vLLM: the GPU
image has none), on the next GPU after the trainers' (NCCL forbids two ranks of a group on one GPU) or on CPU. Each of
``--updates`` updates is the trainer's :func:`~hf_fsdp2.methods.grpo.vllm.transfer.push_weights`: one request, one
all-gather per unit in ``--dtype`` on every rank, one broadcast per unit from rank 0 to the worker. ``--no-server``:
only the gathers, timed the same way.

Reported (the median update after the first, which opens buffers): seconds per update and per gather pass, and the
counts of docs/grpo.md ("What a weight sync and a rollout cost"): all-gathers and their bytes per rank, broadcasts and
their bytes, HTTP requests, host bytes; beside them the per-parameter fp32 path this replaced (one all-gather per
parameter, fp32 bytes) and TRL 1.16's (one ``full_tensor`` per parameter in the parameters' dtype, then 1 GB packed
NCCL broadcasts).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SERVER = REPO / "hf_fsdp2" / "methods" / "grpo" / "vllm" / "server.py"
SHAPES = {  # LlamaConfig fields
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=2048, tie_word_embeddings=False),
    "smol": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
}  # fmt: skip
TRL_PACK_BYTES = 1 << 30  # vLLM's packed broadcast buffer, which TRL 1.16's server sync uses


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smol")
    ap.add_argument("--procs", type=int, default=2, help="trainer ranks")
    ap.add_argument("--updates", type=int, default=4)
    ap.add_argument(
        "--dtype", default=None, help="the engine's dtype (default: float32 on CPU, bfloat16 on GPUs)"
    )
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU")
    ap.add_argument("--no-server", action="store_true", help="the gathers only (one GPU)")
    ap.add_argument("--out", default=None, help="write the JSON report here")
    ap.add_argument("--role", choices=("run", "server", "trainer"), default="run", help=argparse.SUPPRESS)
    ap.add_argument("--url", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.cpu else "bfloat16")
    return args


# ---- the receiver: the server's code over a stand-in engine -------------------------------------------------------


class _Worker:
    """One engine worker: its rank and device, and vLLM's in-place reload as a copy into its own weights."""

    def __init__(self, device: str) -> None:
        import torch

        self.rank, self.device, self.weights = 0, torch.device(device), {}
        self.model_runner = types.SimpleNamespace(get_model=lambda: None)

    def reload_weights(self, weights_iterator: Any, is_checkpoint_format: bool) -> None:
        import torch

        for name, tensor in weights_iterator:
            if name not in self.weights:
                self.weights[name] = torch.empty_like(tensor)
            self.weights[name].copy_(tensor)


class _Engine:
    """What the server's ``Engine`` asks of vLLM's ``LLM`` for a weight update."""

    def __init__(self, device: str, dtype: str) -> None:
        import torch

        self.worker = _Worker(device)
        self.llm_engine = types.SimpleNamespace(
            model_config=types.SimpleNamespace(dtype=getattr(torch, dtype))
        )

    def collective_rpc(
        self, method: Any, timeout: float | None = None, args: tuple = (), kwargs: Any = None
    ) -> list:
        return [method(self.worker, *args, **(kwargs or {}))]

    def reset_prefix_cache(self) -> bool:
        return True


def serve(args: argparse.Namespace) -> None:
    from http.server import ThreadingHTTPServer

    import torch

    if args.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(args.device))
    sys.modules["vllm"] = types.SimpleNamespace(SamplingParams=types.SimpleNamespace(__struct_fields__=()))  # type: ignore[assignment]
    spec = importlib.util.spec_from_file_location("vllm_server", SERVER)
    assert spec and spec.loader
    server = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(server)
    engine = server.Engine.__new__(server.Engine)
    engine.llm, engine.model_path, engine.dtype = _Engine(args.device, args.dtype), "bench", args.dtype
    engine.setup()
    httpd = ThreadingHTTPServer(("127.0.0.1", args.port), server.handler(engine))
    print(f"ready http://127.0.0.1:{httpd.server_address[1]}", flush=True)
    httpd.serve_forever()


# ---- the trainer ranks ------------------------------------------------------------------------------------------


def build_model(shape: str, device: Any) -> Any:
    """A random Llama of ``shape`` on ``device``, fp32 master weights, sharded with FSDP2: each decoder layer, the
    untied embeddings and head, the root (which holds a tied pair, so it stays one parameter)."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    for layer in model.model.layers:
        fully_shard(layer)
    if not config.tie_word_embeddings:  # a tied pair stays in the root's unit, so it stays one parameter
        fully_shard(model.model.embed_tokens)
        fully_shard(model.lm_head)
    fully_shard(model)
    return model


def train_side(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from hf_fsdp2.methods.grpo.vllm.client import ServerSettings, VllmClient
    from hf_fsdp2.methods.grpo.vllm.transfer import DTYPES, WeightGroup, push_weights
    from hf_fsdp2.parallel.gather import GatherCounts, gathered_units, sync_units

    gpu = not args.cpu
    if gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    model = build_model(args.shape, device)
    sync = lambda: torch.cuda.synchronize() if gpu else None  # noqa: E731

    def timed(fn: Any) -> tuple[list[float], Any]:
        seconds, out = [], None
        for _ in range(args.updates):
            dist.barrier()
            sync()
            start = time.perf_counter()
            out = fn()
            sync()
            dist.barrier()
            seconds.append(time.perf_counter() - start)
        return seconds, out

    def gathers() -> GatherCounts:
        counts = GatherCounts()
        for _ in gathered_units(sync_units(model), DTYPES[args.dtype], rank == 0, counts):
            pass
        return counts

    gather_s, gather_counts = timed(gathers)
    report: dict[str, Any] = {"gather_seconds": gather_s, "gather": vars(gather_counts)}
    if args.url:
        client = VllmClient(ServerSettings(args.url, timeout=60, request_timeout=600))
        group = None
        if rank == 0:
            info = client.wait_until_up()
            group = WeightGroup.open(client, info, device, 0, timeout_s=600.0, connect_s=60.0)
        versions = iter(range(1, args.updates + 1))
        update_s, counts = timed(lambda: push_weights(model, client, group, next(versions), args.dtype))
        report["update_seconds"] = update_s
        report["update"] = counts.as_dict()
    if rank == 0:
        units = sync_units(model)
        report.update(
            world=world,
            params=sum(len(u) for u in units),
            units=len(units),
            numel=sum(p.numel() for u in units for _, p in u),
            formula_bytes=sum(
                world * math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) for u in units for _, p in u
            )
            * DTYPES[args.dtype].itemsize,
        )
        print("REPORT " + json.dumps(report), flush=True)
    dist.destroy_process_group()


# ---- the launcher -----------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": str(REPO)}
    server, url = None, None
    if not args.no_server:
        device = "cpu" if args.cpu else f"cuda:{args.procs}"
        cmd = [sys.executable, __file__, "--role", "server", "--device", device, "--dtype", args.dtype]
        server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        assert server.stdout is not None
        line = server.stdout.readline()
        if not line.startswith("ready "):
            raise SystemExit(f"the receiver did not start: {line!r}")
        url = line.split()[1]
    try:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.procs), "--master_addr",
            "127.0.0.1", "--master_port", str(_free_port()), __file__, "--role", "trainer", "--shape", args.shape,
            "--updates", str(args.updates), "--dtype", args.dtype, *(["--cpu"] if args.cpu else []),
            *(["--url", url] if url else []),
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        found = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
        if proc.returncode or not found:
            raise SystemExit(f"the trainer ranks failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        report = json.loads(found[0][len("REPORT ") :])
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
    return summarise(args, report)


def summarise(args: argparse.Namespace, r: dict[str, Any]) -> dict[str, Any]:
    """The medians (the first update left out: it opens the buffers) and the before / TRL counts beside them."""
    median = lambda xs: statistics.median(xs[1:] or xs)  # noqa: E731
    b = 2 if args.dtype in ("bfloat16", "float16") else 4
    out: dict[str, Any] = {
        "shape": args.shape,
        "ranks": r["world"],
        "device": "cpu (gloo)" if args.cpu else "cuda (nccl)",
        "dtype": args.dtype,
        "gather_s": median(r["gather_seconds"]),
        "counts": {**r.get("update", {}), "all_gathers": r["gather"]["collectives"], "gathered_bytes": r["gather"]["bytes"]},
        "formula": {"all_gathers": r["units"], "gathered_bytes": r["formula_bytes"], "broadcasts": r["units"],
                    "broadcast_bytes": r["numel"] * b, "requests": 1, "host_bytes": 0},
        "per_parameter_fp32": {"all_gathers": r["params"], "gathered_bytes": r["numel"] * 4,
                               "host_bytes_rank0": r["numel"] * 4, "http_bytes": r["numel"] * 4},
        "trl_1_16": {"all_gathers": r["params"], "broadcasts": math.ceil(r["numel"] * b / TRL_PACK_BYTES)},
    }  # fmt: skip
    if "update_seconds" in r:
        out["update_s"] = median(r["update_seconds"])
        out["update_seconds"] = r["update_seconds"]
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role == "server":
        serve(args)
        return 0
    if args.role == "trainer":
        train_side(args)
        return 0
    result = run(args)
    c = result["counts"]
    print(
        f"{result['shape']} on {result['ranks']} rank(s), {result['device']}, {result['dtype']}: "
        f"update {result.get('update_s', float('nan')):.3f} s, gathers alone {result['gather_s']:.3f} s; "
        f"{c['all_gathers']} all-gathers of {c['gathered_bytes'] / 1e9:.3f} GB per rank, "
        f"{c.get('broadcasts', 0)} broadcasts of {c.get('broadcast_bytes', 0) / 1e9:.3f} GB, "
        f"{c.get('requests', 0)} request(s), host bytes {c.get('host_bytes', 0)} "
        f"(per-parameter fp32: {result['per_parameter_fp32']['all_gathers']} all-gathers of "
        f"{result['per_parameter_fp32']['gathered_bytes'] / 1e9:.3f} GB)"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
