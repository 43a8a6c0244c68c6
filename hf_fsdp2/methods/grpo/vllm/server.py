"""The vLLM rollout server of the GRPO recipe (``use_vllm: true``, ``vllm_mode: server``): one process holding a vLLM
engine, which the trainer's ranks ask for completions over HTTP and send new weights to after each update.

Started by ``hf-fsdp2 vllm-serve --model DIR --port N`` (:mod:`hf_fsdp2.commands.vllm_serve`), which runs this file
with a Python that has vLLM (its own virtual environment, ``.venv-vllm``: vLLM pins a transformers older than the
trainer's). This file imports nothing of hf_fsdp2 (the package's ``__init__`` files import the trainer's stack,
which that environment does not have): it runs by path (``python -P server.py``), the standard library's HTTP
server, JSON and safetensors bytes on the wire (no torch.distributed group between trainer and server, so a server
that dies is a failed request, never a hung collective).

Endpoints (every answer is JSON):

- ``GET /health``: the model, the dtype, the weights' version (0: as loaded; then the trainer's update count).
- ``POST /generate`` ``{prompts, seeds, max_tokens, temperature, top_p, top_k, greedy, stop_token_ids,
  generation_kwargs}``: one completion per prompt, its token ids and each token's sampling log-prob (vLLM's
  ``processed_logprobs``: after temperature, top-k and top-p, the distribution the token was drawn from), each prompt
  with its own seed; ``generation_kwargs``: more ``SamplingParams`` fields (``/health`` lists them as
  ``sampling_fields``).
- ``POST /weights`` (body: safetensors bytes of some tensors, HF names): staged; ``POST /weights/commit``
  ``{version, tensors}``: the staged tensors loaded into the engine at once (vLLM's in-place reload, which fuses
  q/k/v and gate/up itself), the prefix cache dropped, the version set. Staging keeps one CPU copy of the weights
  on the server side while an update arrives; the trainer sends one layer at a time and never holds them all. The
  load reaches every worker of the engine through vLLM's ``collective_rpc`` (:func:`load_in_worker`): in this
  process at ``--tensor-parallel-size 1``, each worker process (which keeps its shard of each full tensor) above
  it; the answer counts the workers and refuses a commit that any of them did not load whole.
- ``POST /logprobs`` ``{prompt, completion}``: the log-prob of each completion token given what precedes it
  (temperature 1): the trainer's probe that the engine runs the weights it was sent.

One lock serialises engine calls (requests from several ranks queue); ``/health`` does not take it.
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

PROTOCOL = 2  # bumped when a request or answer changes shape; the client refuses another
logger = logging.getLogger("hf_fsdp2.vllm_server")


class Engine:
    """The vLLM engine and the weights being staged."""

    def __init__(self, args: argparse.Namespace) -> None:
        # In-process engine core: collective_rpc hands load_in_worker straight to the executor (which sends it to
        # any worker processes by value), and no second process to orphan.
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
            enable_prefix_caching=False,
            logprobs_mode="processed_logprobs",
        )
        # No prefix cache: a rollout's numbers then never depend on what earlier requests left cached, so a resumed
        # run samples what the uninterrupted one did.
        self.model_path, self.dtype = (
            args.model,
            str(self.llm.llm_engine.model_config.dtype).replace("torch.", ""),
        )
        self.version = 0
        self.staged: dict[str, Any] = {}
        self.lock = threading.Lock()

    def load(self, weights: Iterable[tuple[str, Any]], version: int, expected: int | None = None) -> int:
        """``weights`` (HF names, full tensors) into every worker of the engine (:func:`load_in_worker` through
        ``collective_rpc``, which works for every vLLM executor: the model lives in the workers, one per
        tensor-parallel rank), the prefix cache dropped, the version set; the caller holds the lock. ``weights``
        may be a lazy iterator at tensor parallel size 1 (the workers run in this process); above it, a list (it is
        sent to each worker process). Returns the number of workers.

        Raises:
            ValueError: a worker loaded another number of tensors than ``expected`` (the version is kept).
        """
        counts = self.llm.collective_rpc(load_in_worker, args=(weights,))
        if expected is not None and any(int(c) != expected for c in counts):
            raise ValueError(
                f"weights update {version}: the engine's {len(counts)} workers loaded {list(counts)} tensors of the "
                f"{expected} sent, so they no longer hold one model; the engine keeps version {self.version} (the "
                "trainer stops on it): restart hf-fsdp2 vllm-serve"
            )
        self.llm.reset_prefix_cache()
        self.version = version
        return len(counts)

    def health(self) -> dict[str, Any]:
        from vllm import SamplingParams

        # The fields a request's generation_kwargs may name (the trainer checks them before its first rollout).
        fields = [f for f in SamplingParams.__struct_fields__ if not f.startswith("_")]
        return {
            "status": "ok",
            "protocol": PROTOCOL,
            "model": self.model_path,
            "dtype": self.dtype,
            "weights_version": self.version,
            "pid": os.getpid(),
            "sampling_fields": fields,
        }

    def generate(self, req: dict[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams

        prompts: list[list[int]] = req["prompts"]
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
            for seed in seeds
        ]
        with self.lock:
            outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
            version = self.version
        completions, logprobs = [], []
        for out in outs:
            choice = out.outputs[0]
            ids = list(choice.token_ids)
            completions.append(ids)
            logprobs.append(
                [float(step[tok].logprob) for step, tok in zip(choice.logprobs or [], ids, strict=False)]
            )
        return {"completions": completions, "logprobs": logprobs, "weights_version": version}

    def logprobs(self, req: dict[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams

        prompt, completion = list(req["prompt"]), list(req["completion"])
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, logprobs=0)
        with self.lock:
            out = self.llm.generate([{"prompt_token_ids": prompt + completion}], params, use_tqdm=False)[0]
            version = self.version
        steps = out.prompt_logprobs or []
        ids = prompt + completion
        values = [float(steps[i][ids[i]].logprob) for i in range(len(prompt), len(ids))]
        return {"logprobs": values, "weights_version": version}

    def stage(self, body: bytes) -> dict[str, Any]:
        from safetensors.torch import load

        tensors = load(body)
        with self.lock:
            self.staged.update(tensors)
            return {"staged": len(self.staged)}

    def commit(self, req: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            staged, self.staged = self.staged, {}
            want = int(req["tensors"])
            if len(staged) != want:
                raise ValueError(
                    f"weights update {req['version']}: {len(staged)} tensors arrived of the {want} sent (a request was "
                    "lost or came from two trainers at once); nothing loaded, the engine keeps version "
                    f"{self.version}"
                )
            start = time.perf_counter()
            workers = self.load(list(staged.items()), int(req["version"]), expected=want)
            seconds = time.perf_counter() - start
        logger.info(
            "weights version %d loaded (%d tensors into each of %d workers, %.2f s)",
            self.version,
            len(staged),
            workers,
            seconds,
        )
        return {
            "weights_version": self.version,
            "loaded": len(staged),
            "workers": workers,
            "seconds": seconds,
        }


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
                "/weights": lambda: engine.stage(body),
                "/weights/commit": lambda: engine.commit(json.loads(body)),
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
