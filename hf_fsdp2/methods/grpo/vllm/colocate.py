"""GRPO's vLLM rollouts inside the training processes (``use_vllm: true``, ``vllm_mode: colocate``, as TRL 1.16's
colocate mode): every rank holds a vLLM engine (``distributed_executor_backend="external_launcher"``), or a
tensor-parallel shard of one shared by ``vllm_tensor_parallel_size`` consecutive ranks, and samples its own share of
each generation batch; after each optimizer update the next rollout first loads the policy into every engine.

- Where it runs: a Python that imports both the trainer and vLLM. vLLM pins transformers<5.20 and its own torch,
  so that is ``.venv-vllm`` (``scripts/setup_vllm.sh`` installs the trainer's dependencies there under vLLM's pins):
  ``PYTHONPATH=<checkout> .venv-vllm/bin/python -m hf_fsdp2.cli train grpo --config_file accelerate_configs/...
  --config r.yaml`` (:func:`run_command`). Elsewhere the recipe stops before loading with that command
  (:func:`require_vllm`).
- Rollouts: an engine gets its ranks' completions of the generation batch in one call, each prompt once with ``n``
  = its completions there (a group split between engines: each its part), completion ``k`` drawn with seed
  ``rollout seed + k`` as in the server mode; the ranks of a tensor-parallel engine make the same call (vLLM's
  external launcher needs identical requests on them) and each keeps its share. Prefix caching on, dropped at each
  load and before each rollout.
- Weights: a FSDP unit at a time in the engine's dtype (:func:`~hf_fsdp2.parallel.gather.gathered_units`: one
  all-gather per unit, the same calls in the same order on every rank), each tensor a view of the unit's buffer
  handed to the engine's in-place reload (which fuses q/k/v and gate/up itself) and freed before the next unit. The
  probe and the importance sampling correction are the server mode's (:class:`~.client.VllmGenerator`): here every
  rank probes its own engine.
- Memory: ``vllm_gpu_memory_utilization`` (TRL's default 0.3) of the GPU for each engine. With
  ``vllm_enable_sleep_mode`` (unset: where the start-up plan finds the engine and training do not fit side by side)
  the engine sleeps at level 2 after each rollout (weights and KV cache discarded, nothing
  copied to host memory) and wakes in two steps before the next: its weights, loaded from the policy (every rollout
  then loads them, updated or not), then its KV cache; without it the engine keeps both beside training (the
  start-up plan says which fits). vLLM's CPU backend has no sleep mode (its sleep/wake_up log a warning and do
  nothing): on CPU the key is reported as ignored, and the KV cache takes ``VLLM_CPU_KVCACHE_SPACE`` GiB (1 unless
  set).
- Failures: an engine that fails a request, a weight load or the probe raises :class:`~.client.VllmServerError`
  on every rank at once (:func:`hf_fsdp2.collectives.run_on_all`); a rank whose engine failed mid-load still runs
  the remaining units' gathers first, so no rank waits in a collective.
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
from hf_fsdp2.methods.grpo.batching import completion_runs
from hf_fsdp2.methods.grpo.rollout import SamplingSettings
from hf_fsdp2.methods.grpo.vllm.client import (
    ServerSettings,
    VllmClient,
    VllmGenerator,
    VllmServerError,
    extra_sampling,
)
from hf_fsdp2.methods.grpo.vllm.probe import PROBE_TEXT
from hf_fsdp2.methods.grpo.vllm.transfer import DTYPES, SyncCounts, add_sync_counts
from hf_fsdp2.parallel.gather import GatherCounts, gathered_units, sync_units

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
    model_path: str,
    *,
    dtype: str,
    max_model_len: int,
    gpu_memory_utilization: float,
    sleep_mode: bool,
    tensor_parallel_size: int = 1,
) -> Any:
    """This rank's vLLM engine (or its tensor-parallel shard of one): :class:`~.server.Engine` (its generate, log-prob
    and tied-head code) built over the training processes' own torch.distributed group instead of a server's
    arguments."""
    # The engine core in this process (not a child): collective_rpc runs the in-place reload on its worker here,
    # consuming the gathered weights lazily.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
    from vllm import LLM

    from hf_fsdp2.methods.grpo.vllm.server import Engine

    engine = Engine.__new__(Engine)
    saved = _keep_rng()  # vLLM seeds the process's global generators; the trainer's are put back
    try:
        engine.llm = LLM(
            model=model_path,
            dtype=dtype,
            max_model_len=max_model_len,
            # The ranks of one tensor-parallel engine sample alike (every request carries its own seeds too).
            seed=collectives.rank() // tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            distributed_executor_backend="external_launcher",
            enforce_eager=not on_gpu,
            enable_prefix_caching=True,  # a prompt's n samples share its blocks; dropped at each load and rollout
            logprobs_mode="processed_logprobs",
            max_num_batched_tokens=4096,
            enable_sleep_mode=sleep_mode and on_gpu,
        )
    finally:
        _restore_rng(saved)
    engine.model_path = model_path
    engine.dtype = str(engine.llm.llm_engine.model_config.dtype).replace("torch.", "")
    engine.setup()
    return engine


class LocalClient(VllmClient):
    """The :class:`~.client.VllmClient` requests answered by this rank's engine in-process (the same request
    bodies and answers as the server's endpoints)."""

    def __init__(self, engine: Any) -> None:
        super().__init__(ServerSettings(f"in-process vLLM (rank {collectives.rank()})"))
        self.engine = engine

    def _request(
        self, method: str, path: str, payload: Any = None, timeout: float | None = None
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

    def load(self, weights: Iterator[tuple[str, torch.Tensor]], version: int) -> int:
        """The engine's in-place reload from ``weights`` (consumed lazily: its worker runs in this process), then the
        tied head's CPU repack and the prefix cache dropped, as the server's update. Returns the tensors loaded."""
        with self.engine.lock:
            return int(self.engine.load(weights, version))


def load_weights(model: torch.nn.Module, client: LocalClient, version: int, dtype: str) -> GatherCounts:
    """Every parameter into this rank's engine, a FSDP unit at a time in ``dtype`` (every rank calls it: each unit's
    gather is a collective). Returns this rank's gather counts.

    Raises:
        VllmServerError: on every rank, when some rank's engine failed the load (that rank first runs the gathers
            the others still make) or loaded another count than sent.
    """
    counts = GatherCounts()
    units = sync_units(model)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for unit in gathered_units(units, DTYPES[dtype], True, counts):
            yield from unit.tensors

    stream = tensors()
    error: str | None = None
    try:
        loaded = client.load(stream, version)
        want = sum(len(u) for u in units)
        if loaded != want:
            error = f"the engine loaded {loaded} of the {want} tensors sent"
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
    for _ in stream:  # the remaining gathers, which the other ranks make
        pass

    def outcome() -> None:
        if error is not None:
            raise VllmServerError(f"{client.url} failed to load weights version {version}: {error}")

    collectives.run_on_all("loading the weights into the in-process vLLM engines", outcome, VllmServerError)
    return counts


class ColocateGenerator(VllmGenerator):
    """:class:`~.client.VllmGenerator` over this rank's own engine: the weights loaded in-process by every rank,
    every rank's engine probed; sleep level 2 between rollouts where asked and vLLM offers it.

    ``sleeps`` / ``wakes``: the engine's sleep levels and wake-up tags, in order (what they copy between host and
    device is vLLM's: level 1 moves the weights out and back, level 2 nothing)."""

    client: LocalClient

    def __init__(
        self, *args: Any, sleep_mode: bool = False, tensor_parallel_size: int = 1, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.sleep_mode = sleep_mode and torch.cuda.is_available()
        self.tp = tensor_parallel_size
        self.counts_engine = (
            collectives.rank() % tensor_parallel_size == 0
        )  # one rank per engine counts its calls
        self._asleep = False
        self.sleeps: list[int] = []
        self.wakes: list[str] = []
        self.memory = (
            f"CPU KV cache {os.environ.get('VLLM_CPU_KVCACHE_SPACE')} GiB"  # the GPU's: set by the builder
        )

    def describe(self) -> str:
        s = self.settings
        sleep = "level 2 between rollouts" if self.sleep_mode else "off"
        return (
            f"rollouts: vLLM in each training process (vllm_mode colocate, {self.server_dtype}, tensor parallel "
            f"{self.tp}, {self.memory}, sleep mode {sleep}), temperature {s.temperature:g}, top_p {s.top_p:g}, "
            f"top_k {s.top_k}, min_p {s.min_p or 0:g}, repetition_penalty {s.repetition_penalty:g}, stop ids "
            f"{self.eos_ids}{extra_sampling(s)}; importance sampling correction {self.correction or 'off'}"
        )

    def _wake(self, tag: str) -> None:
        self.client.engine.llm.wake_up(tags=[tag])
        self.wakes.append(tag)

    def sleep(self) -> None:
        """Level 2 (weights and KV cache discarded, nothing to host memory) where sleep mode is on."""
        if self.sleep_mode and not self._asleep:
            self.client.engine.llm.sleep(level=2)
            self.sleeps.append(2)
            self._asleep = True

    def _ready(self) -> None:
        """Awake with the policy's weights: after a level 2 sleep the weights are woken and loaded (they were
        discarded), then the KV cache; else loaded when the policy changed."""
        if self._asleep:
            self._wake("weights")
            self.sync()
            self._wake("kv_cache")
            self._asleep = False
            self.check_probe()
        elif self.stale:
            self.sync()
            self.check_probe()

    def sync(self) -> None:
        """Load the policy's weights into every rank's engine (every rank; the probe follows: :meth:`_ready`)."""
        start = time.perf_counter()
        self.version += 1
        counts = load_weights(self.model, self.client, self.version, self.server_dtype)
        self.stale = False
        self.syncs += 1
        self.last_sync = SyncCounts(gather=counts)
        self.sync_seconds += time.perf_counter() - start
        add_sync_counts(self.counted, self.last_sync)
        if collectives.rank() == 0:
            logger.info(
                "vLLM weights version %d: %d tensors in %d units (%d all-gathers in %s) loaded into each rank's "
                "engine (%.2f s)",
                self.version,
                counts.tensors,
                counts.units,
                counts.collectives,
                self.server_dtype,
                time.perf_counter() - start,
            )

    def check_probe(self) -> float:
        """The largest difference over the ranks between an engine's and the trainer's log-probs of the probe
        completion (every rank asks its own engine).

        Raises:
            VllmServerError: on every rank, when some rank's engine answers outside :func:`~.probe.probe_bound`.
        """
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
        if collectives.rank() == 0:
            logger.info("vLLM weights version %d: probe passed on every rank's engine", self.version)
        return float(collectives.all_reduce_max([diff])[0])

    def _local(self, phase: str, fn: Any) -> Any:
        """``fn()`` on every rank's own engine, a failure raised on every rank."""
        try:
            return collectives.run_on_all(phase, fn, VllmServerError)
        finally:
            self.sleep()

    def generate(
        self, prompts: Sequence[Sequence[int]], *, seed: int, greedy: bool = False
    ) -> list[list[int]]:
        """This rank's completions from its engine (the ranks of a tensor-parallel engine send it all their
        prompts, the same call on each, and each keeps its own)."""
        self._ready()
        mine = [[int(t) for t in p] for p in prompts]
        everyone = collectives.gather_objects((mine, seed)) if self.tp > 1 else [(mine, seed)]
        first = collectives.rank() // self.tp * self.tp if self.tp > 1 else 0
        members = everyone[first : first + self.tp] if self.tp > 1 else everyone

        def ask() -> tuple[list[list[int]], list[list[float]]]:
            flat = [p for part, _ in members for p in part]
            seeds = [(s * 7_919 + i) % (2**31 - 1) for part, s in members for i in range(len(part))]
            return self._ask(flat, [1] * len(flat), None if greedy else seeds, greedy)

        ids, logps = self._local("generating with the in-process vLLM engines", ask)
        start = sum(len(part) for part, _ in members[: collectives.rank() - first]) if self.tp > 1 else 0
        share = slice(start, start + len(mine))
        if not greedy:
            self.pending += logps[share]
        return ids[share]  # type: ignore[no-any-return]

    def generate_groups(
        self, prompts: Sequence[Sequence[int]], n: int, share: slice, *, seed: int
    ) -> list[list[int]]:
        """This rank's ``share`` of the generation batch (every rank calls it with the batch's unique ``prompts``):
        its engine generates the completions of its ranks in one call (:func:`~.batching.completion_runs`), each rank
        keeps its own."""
        self._ready()
        per_rank = share.stop - share.start
        low = collectives.rank() // self.tp * self.tp * per_rank  # the engine's ranks' completions
        runs = completion_runs(low, low + self.tp * per_rank, n)

        def ask() -> tuple[list[list[int]], list[list[float]]]:
            return self._ask(
                [prompts[j] for j, _, _ in runs],
                [c for _, _, c in runs],
                [seed + k for _, k, _ in runs],
                False,
            )

        ids, logps = self._local("generating with the in-process vLLM engines", ask)
        mine = slice(share.start - low, share.stop - low)
        self.pending += logps[mine]
        return ids[mine]  # type: ignore[no-any-return]


def gpu_bytes(device: torch.device) -> int | None:
    """The memory of ``device``'s GPU (None without one)."""
    return torch.cuda.get_device_properties(device).total_memory if torch.cuda.is_available() else None


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
    training_peak: int | None = None,
) -> ColocateGenerator:
    """The GRPO recipe's colocated vLLM generator from its keys (``g``: GrpoArgs): every rank builds its engine (or
    its shard of one) on ``model_path``, in the trainer's compute dtype, marked stale by every optimizer update.
    Sleep mode: the key where set, else rank 0's choice from ``training_peak`` (the start-up plan's peak per rank;
    None: no plan) and its GPU (:func:`~hf_fsdp2.methods.grpo.plan.choose_sleep_mode`), the same on every rank.

    Raises:
        ConfigError: ``vllm_tensor_parallel_size`` does not divide the training processes.
    """
    from hf_fsdp2.methods.grpo.plan import choose_sleep_mode
    from hf_fsdp2.methods.grpo.vllm.importance import correction_from_keys, engine_dtype_name
    from hf_fsdp2.plan.settings import DEFAULT_HEADROOM

    require_vllm()
    tp = int(g.vllm_tensor_parallel_size)
    check(
        collectives.world() % tp == 0,
        f"vllm_tensor_parallel_size={tp} does not divide the {collectives.world()} training processes: each "
        "engine spans that many consecutive ranks; set a divisor of the world size",
    )
    correction = correction_from_keys(g)
    compute = engine_dtype_name(model, mixed_precision)
    if g.vllm_enable_sleep_mode and not torch.cuda.is_available() and collectives.rank() == 0:
        logger.warning(
            "vllm_enable_sleep_mode ignored: vLLM's CPU backend has no sleep mode (its sleep and wake_up "
            "do nothing); the engine keeps its weights and KV cache while the trainer trains"
        )
    sleep_mode, why = choose_sleep_mode(
        g.vllm_enable_sleep_mode,
        peak=training_peak,
        gpu_bytes=gpu_bytes(device),
        utilization=g.vllm_gpu_memory_utilization,
        headroom=DEFAULT_HEADROOM,
    )
    # Rank 0 holds the plan: its choice, on every rank (an engine spanning ranks needs one setting).
    sleep_mode, why = collectives.broadcast_object((sleep_mode, why))
    if collectives.rank() == 0:
        logger.info("vLLM colocate sleep mode: %s", why)
    start = time.perf_counter()
    engine = collectives.run_on_all(
        "starting the in-process vLLM engines",
        lambda: build_engine(
            model_path,
            dtype=compute,
            max_model_len=max_model_len,
            gpu_memory_utilization=g.vllm_gpu_memory_utilization,
            sleep_mode=sleep_mode,
            tensor_parallel_size=tp,
        ),
        VllmServerError,
    )
    if collectives.rank() == 0:
        logger.info(
            "vLLM colocate: %d engine(s) of tensor parallel size %d over %d processes on %s (%s) in %.1f s",
            collectives.world() // tp,
            tp,
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
        sleep_mode=sleep_mode,
        tensor_parallel_size=tp,
    )
    generator.server_dtype = engine.dtype
    generator.check_sampling_fields(engine.health())
    if torch.cuda.is_available():
        generator.memory = f"vllm_gpu_memory_utilization {g.vllm_gpu_memory_utilization:g}"
    generator.sleep()  # asleep until the first rollout (which wakes it and loads the policy first)
    getattr(optimizer, "optimizer", optimizer).register_step_post_hook(generator.mark_stale)
    return generator
