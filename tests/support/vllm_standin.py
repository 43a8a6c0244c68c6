"""A stand-in for vLLM's ``LLM`` under the real server code (hf_fsdp2/methods/grpo/vllm/server.py's ``Engine``, its
HTTP handler and its worker functions), so the trainer's side can be counted without vLLM: engine calls, prompts
handed to the engine, samples per prompt, prefix-cache resets, weight loads, sleep levels and wake-ups, and the
host<->device bytes vLLM's sleep mode would copy. A stand-in ``vllm`` module gives the server its ``SamplingParams``.

Completions are a function of each sample's seed alone (:func:`completion_of`), so a test can tell which seed drew
each completion it got back."""

from __future__ import annotations

import pickle
import threading
import types
from http.server import ThreadingHTTPServer
from typing import Any

import torch

EOS = 2
# Some of vLLM 0.32's SamplingParams fields, as a server's /health lists them (tests/recipes/test_grpo_vllm_server.py
# reads the real list).
FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "min_tokens",
    "bad_words",
    "logit_bias",
    "max_tokens",
    "logprobs",
)


class SamplingParams:
    """vLLM's ``SamplingParams`` as the server builds it: its keyword arguments, kept."""

    __struct_fields__ = (*FIELDS, "repetition_penalty", "stop_token_ids", "prompt_logprobs")

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


def vllm_module() -> types.ModuleType:
    """A ``vllm`` module with this stand-in's ``SamplingParams`` (the server imports it from there): put it in
    ``sys.modules`` for a test only (``monkeypatch.setitem``), else later tests would find a vLLM here."""
    module = types.ModuleType("vllm")
    module.SamplingParams = SamplingParams  # type: ignore[attr-defined]
    return module


def completion_of(seed: int | None, max_tokens: int) -> list[int]:
    """The completion a sample with ``seed`` draws: 1..max_tokens tokens, the last an end id unless cut."""
    s = 0 if seed is None else int(seed)
    length = 1 + s % max_tokens
    ids = [3 + (s * 31 + 7 * i) % 50 for i in range(length)]
    if length < max_tokens:
        ids[-1] = EOS
    return ids


class Worker:
    """One worker of the engine as ``collective_rpc`` reaches it: its rank, device and in-place reload (``reads``: a
    loader that stops after that many tensors)."""

    def __init__(self, rank: int, reads: int | None = None) -> None:
        self.rank, self.device, self.reads = rank, torch.device("cpu"), reads
        self.loaded: dict[str, torch.Tensor] = {}
        self.loads = 0
        self.model_runner = types.SimpleNamespace(get_model=lambda: torch.nn.Module())

    def reload_weights(self, weights_iterator: Any, is_checkpoint_format: bool) -> None:
        assert is_checkpoint_format
        for i, (name, tensor) in enumerate(weights_iterator):
            self.loaded[name] = tensor.clone()
            if self.reads is not None and i + 1 >= self.reads:
                break
        self.loads += 1


class LLM:
    """vLLM's ``LLM`` as the server and the colocate generator use it, recording every call.

    ``collective_rpc`` sends the function by value and its arguments pickled to every worker and runs them at once
    (threads: the workers of a tensor-parallel engine wait in one broadcast together), as vLLM's multi-process
    executor does; ``weight_bytes``: the engine's weights, which sleep level 1 copies to host memory and back."""

    def __init__(self, workers: int = 1, dtype: str = "float32", weight_bytes: int = 0) -> None:
        self.workers = [Worker(r) for r in range(workers)]
        self.llm_engine = types.SimpleNamespace(
            model_config=types.SimpleNamespace(dtype=getattr(torch, dtype))
        )
        self.weight_bytes = weight_bytes
        self.calls: list[dict[str, Any]] = []  # one per generate: prompts and each one's n
        self.resets = 0
        self.events: list[str] = []  # sleep/wake in order
        self.host_bytes = 0
        self._level = 0

    def collective_rpc(
        self, method: Any, timeout: float | None = None, args: tuple = (), kwargs: Any = None
    ) -> list:
        import cloudpickle

        sent = (cloudpickle.dumps(method), None if _lazy(args) else pickle.dumps((args, kwargs or {})))
        answers: list[Any] = [None] * len(self.workers)
        errors: list[BaseException] = []

        def run(i: int) -> None:
            fn = cloudpickle.loads(sent[0])
            a, kw = pickle.loads(sent[1]) if sent[1] is not None else (args, kwargs or {})
            try:
                answers[i] = fn(self.workers[i], *a, **kw)
            except BaseException as err:  # noqa: BLE001 - raised below, as vLLM raises a worker's failure
                errors.append(err)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(self.workers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return answers

    def generate(self, prompts: list[dict[str, Any]], params: list[Any], use_tqdm: bool = False) -> list[Any]:
        self.calls.append(
            {
                "prompts": [p["prompt_token_ids"] for p in prompts],
                "n": [p.n for p in params],
                "params": params,
            }
        )
        outs: list[Any] = []
        for p in params:
            if getattr(p, "prompt_logprobs", None) is not None:  # the probe's request
                ids = prompts[len(outs)]["prompt_token_ids"]
                steps = [None] + [{t: types.SimpleNamespace(logprob=-1.0)} for t in ids[1:]]
                outs.append(types.SimpleNamespace(prompt_logprobs=steps, outputs=[], num_cached_tokens=0))
                continue
            samples = []
            for j in range(int(p.n)):
                seed = (
                    None if p.seed is None else p.seed + j
                )  # vLLM's rule for the n children of a seeded request
                ids = completion_of(seed, int(p.max_tokens))
                steps = [{t: types.SimpleNamespace(logprob=-0.5 - 0.01 * t)} for t in ids]
                samples.append(types.SimpleNamespace(index=j, token_ids=ids, logprobs=steps))
            outs.append(types.SimpleNamespace(outputs=samples, num_cached_tokens=0))
        return outs

    def reset_prefix_cache(self) -> bool:
        self.resets += 1
        return True

    def sleep(self, level: int = 1) -> None:
        self.events.append(f"sleep{level}")
        if level == 1:  # weights to host memory
            self.host_bytes += self.weight_bytes
        self._level = level

    def wake_up(self, tags: list[str] | None = None) -> bool:
        for tag in tags or ["weights", "kv_cache"]:
            self.events.append(f"wake:{tag}")
            if tag == "weights" and self._level == 1:  # and back
                self.host_bytes += self.weight_bytes
        return True


def _lazy(args: tuple) -> bool:
    """A lazy iterator of weights (colocate, one in-process worker) is handed over as is, not pickled."""
    return any(isinstance(a, types.GeneratorType) or hasattr(a, "__next__") for a in args)


def engine(llm: LLM, dtype: str = "float32") -> Any:
    """The server's ``Engine`` over ``llm`` (the state its constructor would set); ``sys.modules`` must hold
    :func:`vllm_module` while it answers."""
    from hf_fsdp2.methods.grpo.vllm.server import Engine

    e = Engine.__new__(Engine)
    e.llm, e.model_path, e.dtype = llm, "stand-in", dtype
    e.setup()
    return e


def serve(e: Any, behaviour: str = "ok") -> tuple[ThreadingHTTPServer, str, list[tuple[str, int]]]:
    """The server's HTTP handler over ``e`` on a free port, in a thread; returns the server, its URL and the
    (path, body bytes) of every POST it gets. ``behaviour``: ``dies`` (the connection dropped at the weight update,
    as a server process that died), ``unreachable`` (its workers cannot join the weight group), ``slow`` (3 s
    before each update), ``other`` (rollouts answered with weights
    version 99, as a server another trainer updated)."""
    import time

    from hf_fsdp2.methods.grpo.vllm.server import handler

    bodies: list[tuple[str, int]] = []
    base = handler(e)
    if behaviour == "other":
        real = e.generate
        e.generate = lambda req: {**real(req), "weights_version": 99}

    class Counting(base):  # type: ignore[valid-type, misc]
        def do_POST(self) -> None:  # noqa: N802
            bodies.append((self.path, int(self.headers.get("Content-Length", 0))))
            if (
                self.path == "/weights/update" and behaviour == "dies"
            ):  # as a process that died: sockets closed
                for worker in e.llm.workers:
                    worker.hf_fsdp2_weight_group = None
                self.connection.close()
                return
            if (
                self.path == "/weights/group" and behaviour == "unreachable"
            ):  # its workers cannot reach the store
                self._answer(500, {"error": "DistNetworkError: failed to connect to the trainer's store"})
                return
            if self.path == "/weights/update" and behaviour == "slow":
                time.sleep(3)
            super().do_POST()

    class Quiet(ThreadingHTTPServer):
        def handle_error(self, request: Any, client_address: Any) -> None:
            pass  # "dies", "slow": the handler's late write to a closed connection fails; that is the point

    server = Quiet(("127.0.0.1", 0), Counting)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}", bodies
