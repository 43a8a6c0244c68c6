"""The vLLM rollout server of the GRPO recipe (``use_vllm: true``, ``vllm_mode: server``): one process holding a vLLM
engine, which the trainer's rank 0 asks for completions over HTTP and sends new weights to, after each update, over a
process group of its own (device to device).

Started by ``hf-fsdp2 vllm-serve --model DIR --port N`` (:mod:`hf_fsdp2.commands.vllm_serve`), which runs this file
with a Python that has vLLM (its own virtual environment, ``.venv-vllm``: vLLM pins a transformers older than the
trainer's). This file imports nothing of hf_fsdp2 (the package's ``__init__`` files import the trainer's stack,
which that environment does not have): it runs by path (``python -P server.py``), the standard library's HTTP
server and JSON for the control path.

Endpoints (every answer is JSON):

- ``GET /health``: the model, the dtype, the weights' version (0: as loaded; then the trainer's update count), the
  engine's workers, the weight group's backend (``nccl`` on GPUs, ``gloo`` on CPU) and the torch / NCCL versions.
- ``POST /generate`` ``{prompts, counts, seeds, max_tokens, temperature, top_p, top_k, greedy, stop_token_ids,
  generation_kwargs, fresh_cache}``: ``counts[i]`` completions of prompt ``i`` (vLLM's ``n``: the prompt is
  prefilled once, its ``n`` samples share its KV blocks through the prefix cache), the ``j``-th drawn with seed
  ``seeds[i] + j`` (vLLM's rule for the ``n`` children of a seeded request), all prompts in one engine call; their
  token ids and each token's sampling log-prob (vLLM's ``processed_logprobs``: after temperature, top-k and top-p,
  the distribution the token was drawn from); ``fresh_cache``: the prefix cache dropped first, so a rollout's
  numbers never depend on what earlier requests left cached (a resumed run samples what the uninterrupted one did).
  ``generation_kwargs``: more ``SamplingParams`` fields (``/health`` lists them as ``sampling_fields``).
- ``POST /weights/group`` ``{host, port, backend, timeout_s, connect_s}``: every worker of the engine joins the trainer's group
  (:func:`join_weight_group`: rank 0 the trainer, the workers ``1 + their rank``), replacing an earlier one.
- ``POST /weights/update`` ``{version, buckets}``: every worker receives each bucket (one FSDP unit of the trainer,
  its tensors' names and shapes, one dtype) as one broadcast and loads it in place as it arrives
  (:func:`receive_weights`: vLLM's in-place reload, which fuses q/k/v and gate/up itself); answered once all are
  loaded, the prefix cache dropped and the version set. An update that fails midway leaves the engine refusing
  rollouts until a whole one arrives.
- ``POST /logprobs`` ``{prompt, completion}``: the log-prob of each completion token given what precedes it
  (temperature 1): the trainer's probe that the engine runs the weights it was sent.

One lock serialises engine calls; ``/health`` does not take it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PROTOCOL = 3  # bumped when a request or answer changes shape; the client refuses another
logger = logging.getLogger("hf_fsdp2.vllm_server")


class Engine:
    """The vLLM engine, its workers' weight group and the rollouts' requests."""

    def __init__(self, args: argparse.Namespace) -> None:
        # In-process engine core: collective_rpc hands the worker functions straight to the executor (which sends
        # them to any worker processes by value), and no second process to orphan.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        import torch
        from vllm import LLM

        on_gpu = torch.cuda.is_available()
        if not on_gpu:
            # vLLM's CPU backend reserves its KV cache from this variable (GiB); its default, 0.92 of the host's
            # memory, refuses to start beside a trainer.
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
        utilization = args.gpu_memory_utilization if on_gpu else 0.05
        self.llm = LLM(
            model=args.model,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            seed=args.seed,
            gpu_memory_utilization=utilization,
            tensor_parallel_size=args.tensor_parallel_size,
            enforce_eager=args.enforce_eager or not on_gpu,
            # The n samples of a prompt share its KV blocks; the cache is dropped at each weight update and, on the
            # trainer's request, before each rollout (fresh_cache), so what a rollout samples never depends on what
            # earlier requests left cached.
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
        )
        self.model_path, self.dtype = (
            args.model,
            str(self.llm.llm_engine.model_config.dtype).replace("torch.", ""),
        )
        self.setup()

    def setup(self) -> None:
        """The state beside ``self.llm`` (also what a stand-in or an in-process engine built otherwise sets)."""
        self.version = 0
        self.torn: str | None = None  # why rollouts are refused: an update failed midway
        self.lock = threading.Lock()
        self.workers = len(self.llm.collective_rpc(worker_rank))
        self.calls = {"generate": 0, "prompts": 0, "completions": 0, "updates": 0}

    def load(self, weights: Iterable[tuple[str, Any]], version: int) -> int:
        """``weights`` (HF names, full tensors) into this process's worker (tensor parallel size 1: an in-process
        engine, whose iterator stays lazy), the prefix cache dropped, the version set; the caller holds the lock.
        Returns the tensors loaded."""
        (count,) = self.llm.collective_rpc(load_in_worker, args=(weights,))
        self.llm.reset_prefix_cache()
        self.version = version
        return int(count)

    def health(self) -> dict[str, Any]:
        import torch
        from vllm import SamplingParams

        # The fields a request's generation_kwargs may name (the trainer checks them before its first rollout).
        fields = [f for f in SamplingParams.__struct_fields__ if not f.startswith("_")]
        on_gpu = torch.cuda.is_available()
        return {
            "status": "ok",
            "protocol": PROTOCOL,
            "model": self.model_path,
            "dtype": self.dtype,
            "weights_version": self.version,
            "pid": os.getpid(),
            "sampling_fields": fields,
            "workers": self.workers,
            "weight_backend": "nccl" if on_gpu else "gloo",
            "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if on_gpu else None,
            "calls": dict(self.calls),
        }

    def generate(self, req: dict[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams

        prompts: list[list[int]] = req["prompts"]
        counts = req.get("counts") or [1] * len(prompts)
        seeds = req.get("seeds") or [None] * len(prompts)
        greedy = bool(req.get("greedy"))
        extra = dict(
            req.get("generation_kwargs") or {}
        )  # SamplingParams fields, applied last (TRL's meaning)
        if isinstance(extra.get("structured_outputs"), dict):  # JSON carries its fields, as TRL takes them
            from vllm.sampling_params import StructuredOutputsParams

            extra["structured_outputs"] = StructuredOutputsParams(**extra["structured_outputs"])
        params = [
            SamplingParams(
                n=int(n),
                max_tokens=int(req["max_tokens"]),
                temperature=0.0 if greedy else float(req["temperature"]),
                top_p=1.0 if greedy else float(req.get("top_p", 1.0)),
                top_k=0 if greedy else int(req.get("top_k", 0)),
                min_p=0.0 if greedy else float(req.get("min_p", 0.0)),
                repetition_penalty=float(req.get("repetition_penalty", 1.0)),
                seed=seed,
                logprobs=0,
                stop_token_ids=list(req.get("stop_token_ids") or []),
                **extra,
            )
            for n, seed in zip(counts, seeds, strict=True)
        ]
        with self.lock:
            self._check_whole()
            if req.get("fresh_cache"):
                self.llm.reset_prefix_cache()
            outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
            version = self.version
            self.calls["generate"] += 1
            self.calls["prompts"] += len(prompts)
        completions, logprobs, cached = [], [], 0
        for out, n in zip(outs, counts, strict=True):
            cached += int(getattr(out, "num_cached_tokens", 0) or 0)
            for choice in sorted(out.outputs, key=lambda c: c.index)[: int(n)]:
                ids = list(choice.token_ids)
                completions.append(ids)
                logprobs.append(
                    [float(step[tok].logprob) for step, tok in zip(choice.logprobs or [], ids, strict=False)]
                )
        self.calls["completions"] += len(completions)
        return {
            "completions": completions,
            "logprobs": logprobs,
            "weights_version": version,
            "prompt_tokens": sum(len(p) for p in prompts),
            "cached_tokens": cached,
        }

    def logprobs(self, req: dict[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams

        prompt, completion = list(req["prompt"]), list(req["completion"])
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, logprobs=0)
        with self.lock:
            self._check_whole()
            out = self.llm.generate([{"prompt_token_ids": prompt + completion}], params, use_tqdm=False)[0]
            version = self.version
        steps = out.prompt_logprobs or []
        ids = prompt + completion
        values = [float(steps[i][ids[i]].logprob) for i in range(len(prompt), len(ids))]
        return {"logprobs": values, "weights_version": version}

    def _check_whole(self) -> None:
        if self.torn is not None:
            raise ValueError(
                f"{self.torn}: the engine holds a mix of two weight versions and refuses rollouts until the trainer "
                "sends a whole update (a restarted run sends one first)"
            )

    def open_group(self, req: dict[str, Any]) -> dict[str, Any]:
        """Every worker joins the trainer's weight group (the trainer joins at the same time: it asked on a thread)."""
        timeout, connect = float(req["timeout_s"]), float(req.get("connect_s") or req["timeout_s"])
        args = (str(req["host"]), int(req["port"]), 1 + self.workers, str(req["backend"]), timeout, connect)
        with self.lock:
            ranks = self.llm.collective_rpc(join_weight_group, args=args)
        logger.info(
            "weight group with %s:%s joined (%s, ranks %s)", req["host"], req["port"], req["backend"], ranks
        )
        return {"ranks": list(ranks)}

    def update(self, req: dict[str, Any]) -> dict[str, Any]:
        """Every worker receives the buckets and loads them in place; the version set once all did.

        Raises:
            ValueError: a worker failed or loaded another count (the engine is then marked torn).
        """
        version, buckets = int(req["version"]), list(req["buckets"])
        want = sum(len(b["tensors"]) for b in buckets)
        start = time.perf_counter()
        with self.lock:
            try:
                counts = self.llm.collective_rpc(receive_weights, args=(buckets,))
            except Exception as err:
                self.torn = f"weights update {version} failed midway ({type(err).__name__}: {err})"
                raise ValueError(self.torn) from err
            if any(int(c) != want for c in counts):
                self.torn = (
                    f"weights update {version}: the engine's {len(counts)} workers loaded {list(counts)} tensors of "
                    f"the {want} sent"
                )
                raise ValueError(self.torn + "; restart hf-fsdp2 vllm-serve")
            self.torn = None
            self.llm.reset_prefix_cache()
            self.version = version
            self.calls["updates"] += 1
        seconds = time.perf_counter() - start
        logger.info(
            "weights version %d loaded (%d tensors in %d buckets into each of %d workers, %.2f s)",
            version,
            want,
            len(buckets),
            len(counts),
            seconds,
        )
        return {"weights_version": version, "loaded": want, "workers": len(counts), "seconds": seconds}


def worker_rank(worker: Any) -> int:
    """A worker's rank in its engine (run by ``collective_rpc``)."""
    return int(getattr(worker, "rank", 0))


def join_weight_group(
    worker: Any, host: str, port: int, size: int, backend: str, timeout_s: float, connect_s: float
) -> int:
    """Run in each worker of the engine (``collective_rpc``): join the trainer's weight group at ``host:port`` as rank
    ``1 + the worker's rank`` of ``size``, over ``backend`` (the trainer's rank 0 hosts the store), replacing an
    earlier group; the group and the worker's device are kept on the worker. Returns the rank taken."""
    import datetime

    import torch
    import torch.distributed as dist

    worker.hf_fsdp2_weight_group = None  # an earlier trainer's group, gone with it
    rank = 1 + worker_rank(worker)
    timeout = datetime.timedelta(seconds=timeout_s)  # each broadcast's; the rendezvous waits connect_s
    connect = datetime.timedelta(seconds=connect_s)
    store = dist.PrefixStore(
        "hf_fsdp2_weights", dist.TCPStore(host, port, size, is_master=False, timeout=connect)
    )
    group: Any
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = connect
        group = dist.ProcessGroupNCCL(store, rank, size, options)
    else:
        group = dist.ProcessGroupGloo(store, rank, size, connect)
    device = getattr(worker, "device", None) or torch.device("cpu")
    worker.hf_fsdp2_weight_group = (group, device, timeout)
    return rank


def receive_weights(worker: Any, buckets: list[dict[str, Any]]) -> int:
    """Run in each worker (``collective_rpc``): receive each bucket from the trainer's rank 0 (one broadcast into a
    buffer of its dtype on the worker's device) and hand its tensors, views of that buffer, to vLLM's in-place
    reload as they arrive (:func:`load_in_worker`). A loader that stops early still receives every bucket, so the
    trainer never waits on a broadcast; a failure drops the group, so the trainer's sends fail at once. Returns the
    tensors loaded."""
    import math

    import torch
    import torch.distributed as dist

    held = getattr(worker, "hf_fsdp2_weight_group", None)
    if held is None:
        raise ValueError("no weight group: the trainer opens it when it connects (POST /weights/group)")
    group, device, timeout = held
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, timeout

    def stream() -> Iterator[tuple[str, Any]]:
        for bucket in buckets:
            dtype = getattr(torch, bucket["dtype"])
            sizes = [math.prod(shape) for _, shape in bucket["tensors"]]
            flat = torch.empty(sum(sizes), dtype=dtype, device=device)
            group.broadcast([flat], opts).wait()
            at = 0
            for (name, shape), size in zip(bucket["tensors"], sizes, strict=True):
                yield name, flat[at : at + size].view(shape)
                at += size

    weights = stream()
    try:
        loaded = load_in_worker(worker, weights)
        for _ in weights:  # what the loader left: received all the same
            pass
    except Exception:
        worker.hf_fsdp2_weight_group = None
        raise
    return loaded


def load_in_worker(worker: Any, weights: Iterable[tuple[str, Any]]) -> int:
    """Run by ``collective_rpc`` in each worker of the engine (``worker``: vLLM's worker wrapper): the in-place reload
    of ``weights`` (full tensors in checkpoint format: each tensor-parallel worker takes its shard, q/k/v and gate/up
    fused by the model's loader), then the CPU backend's packed copy of a tied output head remade. Returns the
    tensors it loaded.

    vLLM's CPU backend multiplies by the output head through a packed copy of its weight made at load time
    (dispatch_cpu_unquantized_gemm); a tied head's weight is the embedding's, reloaded in place, but the reload
    does not remake its packed copy, so the head kept the first weights (SmolLM2-135M: log-probs 8e-3 nats off the
    sent weights' after an embedding update, 2e-5 once remade). Everything it uses is imported inside: a worker
    process receives the function by value (cloudpickle), not by importing this file.
    """
    import torch

    loaded = 0

    def counted() -> Iterator[tuple[str, Any]]:
        nonlocal loaded
        for item in weights:
            loaded += 1
            yield item

    worker.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
    if not torch.cuda.is_available():
        model = worker.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        if head is not None and getattr(getattr(model, "config", None), "tie_word_embeddings", False):
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            dispatch_cpu_unquantized_gemm(head, remove_weight=False)
    return loaded


def handler(engine: Engine) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
            logger.debug(format, *args)

        def _answer(self, status: int, payload: dict[str, Any]) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path == "/health":
                self._answer(200, engine.health())
            else:
                self._answer(404, {"error": f"no endpoint GET {self.path}"})

        def do_POST(self) -> None:  # noqa: N802
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            routes = {
                "/generate": lambda: engine.generate(json.loads(body)),
                "/logprobs": lambda: engine.logprobs(json.loads(body)),
                "/weights/group": lambda: engine.open_group(json.loads(body)),
                "/weights/update": lambda: engine.update(json.loads(body)),
            }
            if self.path not in routes:
                self._answer(404, {"error": f"no endpoint POST {self.path}"})
                return
            try:
                self._answer(200, routes[self.path]())
            except Exception as err:  # the client raises it, named, on every rank
                logger.exception("%s failed", self.path)
                self._answer(500, {"error": f"{type(err).__name__}: {err}"})

    return Handler


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hf-fsdp2 vllm-serve", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", required=True, help="HF model folder the trainer starts from (config, tokenizer)"
    )
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="auto", help="vLLM's dtype: auto, float32, bfloat16, float16")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + completion tokens at most")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="GPU memory fraction for vLLM")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument(
        "--kv-cache-gib", type=int, default=1, help="CPU only: KV cache GiB (VLLM_CPU_KVCACHE_SPACE)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (always on CPU)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    args = parse_args(argv)
    start = time.perf_counter()
    engine = Engine(args)
    server = ThreadingHTTPServer((args.host, args.port), handler(engine))
    # The line the launcher and the tests wait for: the engine is loaded and the port is bound.
    print(
        f"hf-fsdp2 vllm-serve: ready on http://{args.host}:{args.port} ({args.model}, {engine.dtype}, "
        f"{time.perf_counter() - start:.1f} s)",
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
