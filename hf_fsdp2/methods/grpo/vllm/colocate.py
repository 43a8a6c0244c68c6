"""GRPO's vLLM rollouts inside the training processes (``use_vllm: true``, ``vllm_mode: colocate``, as TRL 1.16's
colocate mode): every rank holds its own vLLM engine (``distributed_executor_backend="external_launcher"``, tensor
parallel size 1) and samples its own prompts; after each optimizer update the next rollout first loads the policy
into every rank's engine.

- Where it runs: a Python that imports both the trainer and vLLM. vLLM pins transformers<5.20 and its own torch,
  so that is ``.venv-vllm`` (``scripts/setup_vllm.sh`` installs the trainer's dependencies there under vLLM's pins):
  ``PYTHONPATH=<checkout> .venv-vllm/bin/python -m hf_fsdp2.cli train grpo --config_file accelerate_configs/...
  --config r.yaml`` (:func:`run_command`). Elsewhere the recipe stops before loading with that command
  (:func:`require_vllm`).
- Weights: one decoder layer at a time, straight from the FSDP2 shards: every rank all-gathers each parameter
  (``DTensor.full_tensor``, the same calls in the same order on every rank) and hands it to its engine's in-place
  reload, which fuses q/k/v and gate/up itself and frees it before the next; no rank builds the whole model apart
  from its engine's own copy. The probe and the importance sampling correction are the server mode's
  (:class:`~.client.VllmGenerator`): here every rank probes its own engine.
- Memory: ``vllm_gpu_memory_utilization`` (TRL's default 0.3) of the GPU for each engine; with
  ``vllm_enable_sleep_mode`` the engine sleeps (level 1: weights to CPU memory, KV cache dropped) outside rollouts
  and wakes before the next. vLLM's CPU backend has no sleep mode (its sleep/wake_up log a warning and do nothing):
  on CPU the key is reported as ignored, and the KV cache takes ``VLLM_CPU_KVCACHE_SPACE`` GiB (1 unless set).
- Failures: an engine that fails a request, a weight load or the probe raises :class:`~.client.VllmServerError`
  on every rank at once (:func:`hf_fsdp2.collectives.run_on_all`); a rank whose engine failed mid-load still runs
  the remaining layers' gathers first, so no rank waits in a collective.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import random
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from hf_fsdp2 import collectives
from hf_fsdp2.config.plans import check
from hf_fsdp2.methods.grpo.rollout import SamplingSettings
from hf_fsdp2.methods.grpo.vllm.client import (
    PROBE_TEXT,
    ServerSettings,
    VllmClient,
    VllmGenerator,
    VllmServerError,
    extra_sampling,
)
from hf_fsdp2.parallel.gather import gathered_layers, layer_groups

logger = logging.getLogger("hf_fsdp2")
CPU_KV_CACHE_GIB = (
    "1"  # VLLM_CPU_KVCACHE_SPACE unless set: vLLM's default (most of the host) starves the trainer
)
REPO = Path(__file__).resolve().parents[4]


def run_command() -> str:
    """The command that runs the GRPO recipe with the Python of the vLLM environment (hf_fsdp2 from the checkout, where
    the accelerate config is named by path: the packaged copy is only in an installed hf_fsdp2)."""
    config = "fsdp2.yaml" if torch.cuda.is_available() else "fsdp2_cpu.yaml"
    return (
        f"PYTHONPATH={REPO} {REPO / '.venv-vllm' / 'bin' / 'python'} -m hf_fsdp2.cli train grpo --config_file "
        f"{REPO / 'accelerate_configs' / config} --config <recipe>"
    )


def require_vllm() -> None:
    """Raises ConfigError naming the command to run when this Python cannot import vLLM (checked without importing
    it: that takes seconds)."""
    check(
        importlib.util.find_spec("vllm") is not None,
        f"vllm_mode=colocate runs vLLM inside each training process, but this Python ({sys.executable}) cannot "
        "import vllm (vLLM pins transformers<5.20 and its own torch, so it lives in .venv-vllm with the trainer's "
        f"dependencies: bash scripts/setup_vllm.sh builds it); run the recipe with that Python: {run_command()}, "
        "or use vllm_mode: server (hf-fsdp2 vllm-serve)",
    )


def _keep_rng() -> tuple[Any, ...]:
    import numpy as np

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def _restore_rng(saved: tuple[Any, ...]) -> None:
    import numpy as np

    random.setstate(saved[0])
    np.random.set_state(saved[1])
    torch.set_rng_state(saved[2])
    if saved[3] is not None:
        torch.cuda.set_rng_state_all(saved[3])


def build_engine(
    model_path: str, *, dtype: str, max_model_len: int, gpu_memory_utilization: float, sleep_mode: bool
) -> Any:
    """This rank's vLLM engine: :class:`~.server.Engine` (its generate, log-prob and tied-head code) built over
    the training processes' own torch.distributed group instead of a server's arguments."""
    # The engine core in this process (not a child): collective_rpc runs the in-place reload on its worker here,
    # consuming the gathered weights lazily.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
    import threading

    from vllm import LLM

    from hf_fsdp2.methods.grpo.vllm.server import Engine

    engine = Engine.__new__(Engine)
    saved = _keep_rng()  # vLLM seeds the process's global generators; the trainer's are put back
    try:
        engine.llm = LLM(
            model=model_path,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=collectives.rank(),
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=1,
            distributed_executor_backend="external_launcher",
            enforce_eager=not on_gpu,
            enable_prefix_caching=False,
            logprobs_mode="processed_logprobs",
            max_num_batched_tokens=4096,
            enable_sleep_mode=sleep_mode and on_gpu,
        )
    finally:
        _restore_rng(saved)
    engine.model_path = model_path
    engine.dtype = str(engine.llm.llm_engine.model_config.dtype).replace("torch.", "")
    engine.version, engine.staged, engine.lock = 0, {}, threading.Lock()
    return engine


class LocalClient(VllmClient):
    """The :class:`~.client.VllmClient` requests answered by this rank's engine in-process (the same request
    bodies and answers as the server's endpoints)."""

    def __init__(self, engine: Any) -> None:
        super().__init__(ServerSettings(f"in-process vLLM (rank {collectives.rank()})"))
        self.engine = engine

    def _request(
        self,
        method: str,
        path: str,
        payload: Any = None,
        raw: bytes | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        routes = {
            "/health": lambda: self.engine.health(),
            "/generate": lambda: self.engine.generate(payload),
            "/logprobs": lambda: self.engine.logprobs(payload),
        }
        if path not in routes:
            raise VllmServerError(f"{self.url}: no request {method} {path} in colocate mode")
        try:
            return routes[path]()  # type: ignore[no-any-return]
        except Exception as err:
            raise VllmServerError(f"{self.url} failed {method} {path}: {type(err).__name__}: {err}") from err

    def wait_until_up(self) -> dict[str, Any]:
        return self.health()

    def load(self, weights: Iterator[tuple[str, torch.Tensor]], version: int) -> None:
        """The engine's in-place reload from ``weights`` (consumed lazily: one tensor at a time), then the tied head's
        CPU repack and the prefix cache dropped, as the server's commit."""
        # Tensor parallel size 1: the engine's one worker runs in this process, so the iterator stays lazy.
        with self.engine.lock:
            self.engine.load(weights, version)


def load_weights(model: torch.nn.Module, client: LocalClient, version: int) -> int:
    """Every parameter's full tensor into this rank's engine, a layer at a time in
    :func:`~hf_fsdp2.parallel.gather.layer_groups`' order (every rank calls it: each gather is a collective). Returns
    the tensors loaded.

    Raises:
        VllmServerError: on every rank, when some rank's engine failed the load (that rank first runs the gathers
            the others still make).
    """
    groups = layer_groups(model)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for layer in gathered_layers(groups):
            yield from layer

    stream = tensors()
    error: str | None = None
    try:
        client.load(stream, version)
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
        for _ in stream:  # the remaining gathers, which the other ranks make
            pass

    def outcome() -> None:
        if error is not None:
            raise VllmServerError(f"{client.url} failed to load weights version {version}: {error}")

    collectives.run_on_all("loading the weights into the in-process vLLM engines", outcome, VllmServerError)
    return sum(len(g) for g in groups)


class ColocateGenerator(VllmGenerator):
    """:class:`~.client.VllmGenerator` over this rank's own engine: the weights loaded in-process by every rank,
    every rank's engine probed; sleep/wake around the rollouts where vLLM offers it."""

    client: LocalClient

    def __init__(self, *args: Any, sleep_mode: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sleep_mode = sleep_mode and torch.cuda.is_available()
        self._asleep = False
        self.memory = (
            f"CPU KV cache {os.environ.get('VLLM_CPU_KVCACHE_SPACE')} GiB"  # the GPU's: set by the builder
        )

    def describe(self) -> str:
        s = self.settings
        return (
            f"rollouts: vLLM in each training process (vllm_mode colocate, {self.server_dtype}, {self.memory}, sleep "
            f"mode {'on' if self.sleep_mode else 'off'}), temperature {s.temperature:g}, top_p {s.top_p:g}, "
            f"top_k {s.top_k}, min_p {s.min_p or 0:g}, repetition_penalty {s.repetition_penalty:g}, stop ids "
            f"{self.eos_ids}{extra_sampling(s)}; importance sampling correction {self.correction or 'off'}"
        )

    def _wake(self) -> None:
        if self._asleep:
            self.client.engine.llm.wake_up()
            self._asleep = False

    def _sleep(self) -> None:
        if self.sleep_mode:
            self.client.engine.llm.sleep(level=1)
            self._asleep = True

    def sync(self) -> None:
        """Load the policy's weights into every rank's engine, then probe each (every rank)."""
        start = time.perf_counter()
        self._wake()
        self.version += 1
        loaded = load_weights(self.model, self.client, self.version)
        self.check_probe()
        self.stale = False
        self.syncs += 1
        self.sync_seconds += time.perf_counter() - start
        if collectives.rank() == 0:
            logger.info(
                "vLLM weights version %d: %d tensors loaded layer by layer into each rank's engine, probe "
                "passed (%.2f s)",
                self.version,
                loaded,
                time.perf_counter() - start,
            )

    def check_probe(self) -> float:
        """The largest difference over the ranks between an engine's and the trainer's log-probs of the probe
        completion (every rank asks its own engine).

        Raises:
            VllmServerError: on every rank, when some rank's engine answers outside :func:`~.client.probe_bound`.
        """
        self._wake()
        prompt, completion, mine, bound, layers = self._probe_reference()

        def ask() -> float:
            answer = self.client.logprobs(prompt, completion)
            self._check_version(answer, "the probe")
            diff = float((torch.tensor(answer["logprobs"], dtype=torch.float64) - mine).abs().max())
            if not diff <= bound:  # NaN fails too
                raise VllmServerError(
                    f"{self.client.url} runs other weights than the trainer's: the probe completion's log-probs "
                    f"differ by up to {diff:.3g} nats (bound {bound:.3g} for {self.server_dtype} vs "
                    f"{self.compute_dtype}, {layers} layers) after weights version {self.version}; a weight load "
                    "that did not reach the engine's kernels (please report it with the model's architecture)"
                )
            return diff

        diff = collectives.run_on_all("probing the in-process vLLM engines' weights", ask, VllmServerError)
        return float(collectives.all_reduce_max([diff])[0])

    def generate(
        self, prompts: Sequence[Sequence[int]], *, seed: int, greedy: bool = False
    ) -> list[list[int]]:
        self._wake()
        try:
            return super().generate(prompts, seed=seed, greedy=greedy)
        finally:
            self._sleep()


def build_colocate_generator(
    g: Any,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    tokenizer: Any,
    eos_ids: Sequence[int],
    sampling: SamplingSettings,
    mixed_precision: str,
    device: torch.device,
    model_path: str,
    max_model_len: int,
) -> ColocateGenerator:
    """The GRPO recipe's colocated vLLM generator from its keys (``g``: GrpoArgs): every rank builds its engine on
    ``model_path``, in the trainer's compute dtype, marked stale by every optimizer update."""
    from hf_fsdp2.methods.grpo.vllm.importance import correction_from_keys, engine_dtype_name

    require_vllm()
    correction = correction_from_keys(g)
    compute = engine_dtype_name(model, mixed_precision)
    if g.vllm_enable_sleep_mode and not torch.cuda.is_available() and collectives.rank() == 0:
        logger.warning(
            "vllm_enable_sleep_mode ignored: vLLM's CPU backend has no sleep mode (its sleep and wake_up "
            "do nothing); the engine keeps its weights and KV cache while the trainer trains"
        )
    start = time.perf_counter()
    engine = collectives.run_on_all(
        "starting the in-process vLLM engines",
        lambda: build_engine(
            model_path,
            dtype=compute,
            max_model_len=max_model_len,
            gpu_memory_utilization=g.vllm_gpu_memory_utilization,
            sleep_mode=g.vllm_enable_sleep_mode,
        ),
        VllmServerError,
    )
    if collectives.rank() == 0:
        logger.info(
            "vLLM colocate: an engine in each of %d processes on %s (%s) in %.1f s",
            collectives.world(),
            model_path,
            engine.dtype,
            time.perf_counter() - start,
        )
    probe = tuple(tokenizer(text, add_special_tokens=False)["input_ids"] for text in PROBE_TEXT)
    generator = ColocateGenerator(
        model,
        LocalClient(engine),
        eos_ids=eos_ids,
        settings=sampling,
        probe=probe,  # type: ignore[arg-type]
        compute_dtype=compute,
        device=device,
        correction=correction,
        sleep_mode=g.vllm_enable_sleep_mode,
    )
    generator.server_dtype = engine.dtype
    generator.check_sampling_fields(engine.health())
    if torch.cuda.is_available():
        generator.memory = f"vllm_gpu_memory_utilization {g.vllm_gpu_memory_utilization:g}"
    generator._sleep()  # asleep until the first rollout (which loads the policy first)
    getattr(optimizer, "optimizer", optimizer).register_step_post_hook(generator.mark_stale)
    return generator
