"""The trainer's side of vLLM rollouts (``use_vllm: true``, ``vllm_mode: server``): HTTP requests to the server of
:mod:`.server` (started by ``hf-fsdp2 vllm-serve``), a :class:`~.rollout.Generator` over it, and the weight sync after
each optimizer update. Rank 0 alone talks to the server; the other ranks take part in the same collectives.

- Completions: a generation batch reaches the engine as one call from rank 0 (:meth:`VllmGenerator.generate_groups`):
  its unique prompts, each with ``n = num_generations`` (prefilled once, its samples sharing its KV blocks), the
  ``k``-th completion of the batch drawn with seed ``rollout seed + k`` whatever rank it falls on; the answer (each
  completion's token ids and sampling log-probs, kept for the importance sampling correction, :mod:`.importance`)
  goes to every rank, which keeps its share. Per-rank calls (the evaluation's greedy completions) are gathered to
  rank 0 the same way: one engine call for every rank's prompts.
- Weights: after an optimizer update, the next rollout first sends the policy (:func:`~.transfer.push_weights`): one
  request, then each FSDP unit gathered in the engine's dtype on every rank and broadcast by rank 0 over the
  trainer-server group (:class:`~.transfer.WeightGroup`, opened when the run connects); then a probe compares the
  engine's log-probs of a fixed completion with the trainer's own within :func:`probe_bound`.
- Failures: a server that is not up (within ``vllm_server_timeout``), does not answer a request (within
  ``vllm_request_timeout``), dies, or answers with weights other than the ones sent (a version the trainer did not
  commit, or a probe outside its bound) raises :class:`VllmServerError` on every rank at once
  (:func:`hf_fsdp2.collectives.run_on_all`): never a rank left waiting in a collective.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hf_fsdp2 import collectives
from hf_fsdp2.methods.grpo.batching import completion_runs
from hf_fsdp2.methods.grpo.config import check_vllm_fields
from hf_fsdp2.methods.grpo.rollout import SamplingSettings
from hf_fsdp2.methods.grpo.vllm.probe import PROBE_TEXT, probe_bound
from hf_fsdp2.methods.grpo.vllm.transfer import (
    COUNTED,
    SyncCounts,
    VllmServerError,
    WeightGroup,
    add_sync_counts,
    push_weights,
)

logger = logging.getLogger("hf_fsdp2")
PROTOCOL = 3  # server.PROTOCOL (that file imports nothing of hf_fsdp2, nor this of it: it needs vLLM)
START_HINT = (
    "start it with `hf-fsdp2 vllm-serve --model <the run's model_name_or_path> --port <vllm_server_port>`"
)


@dataclass(frozen=True)
class ServerSettings:
    """Where the server is and how long to wait for it (TRL's names, plus the per-request timeout)."""

    base_url: str
    timeout: float = 240.0  # vllm_server_timeout: until the server answers /health at start
    request_timeout: float = 600.0  # vllm_request_timeout: one request (a rollout, an update), one broadcast
    group_port: int = 0  # vllm_group_port: the weight group's store on the trainer's rank 0 (0: a free port)


class VllmClient:
    """HTTP requests to one server; every failure is a :class:`VllmServerError` naming the URL, the request and the
    fix."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.url = settings.base_url.rstrip("/")

    def _request(
        self, method: str, path: str, payload: Any = None, timeout: float | None = None
    ) -> dict[str, Any]:
        data = json.dumps(payload).encode() if payload is not None else None
        headers = {"Content-Type": "application/json"}
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        limit = self.settings.request_timeout if timeout is None else timeout
        try:
            with urllib.request.urlopen(request, timeout=limit) as answer:
                return json.loads(answer.read())  # type: ignore[no-any-return]
        except urllib.error.HTTPError as err:
            try:
                detail = json.loads(err.read()).get("error", "")
            except ValueError:
                detail = ""
            raise VllmServerError(
                f"the vLLM server at {self.url} failed {method} {path} (HTTP {err.code}): "
                f"{detail or err.reason}"
            ) from err
        except TimeoutError as err:
            raise VllmServerError(
                f"the vLLM server at {self.url} did not answer {method} {path} within "
                f"vllm_request_timeout={limit:g} s: raise it if the rollout is long, or check "
                "the server's log"
            ) from err
        except (urllib.error.URLError, ConnectionError, OSError) as err:
            reason = getattr(err, "reason", err)
            if isinstance(reason, TimeoutError):
                raise VllmServerError(
                    f"the vLLM server at {self.url} did not answer {method} {path} within "
                    f"vllm_request_timeout={limit:g} s"
                ) from err
            raise VllmServerError(
                f"the vLLM server at {self.url} is not answering ({method} {path}: {reason}): "
                f"it is not running or died; {START_HINT}"
            ) from err

    def health(self, timeout: float = 10.0) -> dict[str, Any]:
        return self._request("GET", "/health", timeout=timeout)

    def wait_until_up(self) -> dict[str, Any]:
        """The server's /health, polled until it answers or ``vllm_server_timeout`` passes."""
        deadline = time.monotonic() + self.settings.timeout
        while True:
            try:
                info = self.health(timeout=max(1.0, min(10.0, self.settings.timeout)))
                break
            except VllmServerError as err:
                if time.monotonic() >= deadline:
                    raise VllmServerError(
                        f"no vLLM server answered at {self.url} within vllm_server_timeout="
                        f"{self.settings.timeout:g} s ({err}); {START_HINT}, or set "
                        "vllm_server_base_url / vllm_server_host / vllm_server_port to where it "
                        "runs"
                    ) from err
                time.sleep(1.0)
        if info.get("protocol") != PROTOCOL:
            raise VllmServerError(
                f"the server at {self.url} speaks protocol {info.get('protocol')!r}, this trainer "
                f"{PROTOCOL}: restart it with this checkout's `hf-fsdp2 vllm-serve`"
            )
        return info

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        counts: Sequence[int],
        seeds: Sequence[int] | None,
        settings: SamplingSettings,
        stop_ids: Sequence[int],
        greedy: bool,
    ) -> dict[str, Any]:
        """``counts[i]`` completions of prompt ``i``, in one engine call (the prefix cache dropped first: a rollout's
        numbers depend on its own request alone)."""
        return self._request(
            "POST",
            "/generate",
            {
                "prompts": [list(map(int, p)) for p in prompts],
                "counts": [int(n) for n in counts],
                "seeds": list(seeds) if seeds is not None else None,
                "max_tokens": settings.max_completion_length,
                "temperature": settings.temperature,
                "top_p": settings.top_p,
                "top_k": settings.top_k,
                "min_p": settings.min_p or 0.0,
                "repetition_penalty": settings.repetition_penalty,
                "greedy": greedy,
                "stop_token_ids": list(stop_ids),
                "generation_kwargs": dict(settings.generation_kwargs),
                "fresh_cache": True,
            },
        )

    def logprobs(self, prompt: Sequence[int], completion: Sequence[int]) -> dict[str, Any]:
        return self._request("POST", "/logprobs", {"prompt": list(prompt), "completion": list(completion)})

    def open_group(
        self, host: str, port: int, backend: str, timeout_s: float, connect_s: float
    ) -> dict[str, Any]:
        """The engine's workers join the weight group whose store is at ``host:port`` (blocks until the trainer's
        end joins too, up to ``connect_s``)."""
        payload = {
            "host": host,
            "port": port,
            "backend": backend,
            "timeout_s": timeout_s,
            "connect_s": connect_s,
        }
        return self._request("POST", "/weights/group", payload)

    def update_weights(self, version: int, buckets: list[dict[str, Any]]) -> dict[str, Any]:
        """The workers receive ``buckets`` over the weight group and load them (answered once loaded)."""
        return self._request("POST", "/weights/update", {"version": version, "buckets": buckets})


class VllmGenerator:
    """Completions from the vLLM server (the :class:`~.rollout.Generator` protocol), with the weights sent after
    each optimizer update (:meth:`mark_stale`, an optimizer step hook) and checked by a probe.

    :meth:`take_logps`: the sampling log-probs of this rank's completions sampled since the last take (one list per
    completion, in order; greedy calls keep none), which the step's importance sampling correction reads.
    ``probe``: the token ids of a fixed prompt and completion. ``last_sync``: the counts of the last weight update
    (:class:`~.transfer.SyncCounts`); ``engine_calls`` / ``engine_prompts``: the engine calls this rank made and the
    prompts they carried (the server mode: rank 0's, one call per generation batch of its unique prompts).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        client: VllmClient,
        *,
        eos_ids: Sequence[int],
        settings: SamplingSettings,
        probe: tuple[Sequence[int], Sequence[int]],
        compute_dtype: str,
        device: torch.device,
        correction: Any = None,
    ) -> None:
        self.model, self.client, self.eos_ids, self.settings = model, client, list(eos_ids), settings
        self.probe, self.compute_dtype, self.device = probe, compute_dtype, device
        self.correction = correction  # importance.ImportanceSampling, or None (no correction)
        self.version = 0  # the weights version the server was last given by this trainer (0: none yet)
        self.stale = (
            True  # the server's weights are not (known to be) the policy's: sent before the next rollout
        )
        self.server_dtype = "float32"
        self.pending: list[list[float]] = []
        self.syncs, self.sync_seconds = 0, 0.0
        self.group: WeightGroup | None = None  # rank 0's end of the weight group
        self.last_sync: SyncCounts | None = None
        self.engine_calls, self.engine_prompts = 0, 0
        self.counts_engine = True  # this rank counts its engine calls (colocate: one rank per engine)
        self.counted = dict.fromkeys(COUNTED, 0.0)  # running totals, read by timing.TimedGenerator

    def describe(self) -> str:
        """The start-up line: where the rollouts come from and how they are sampled."""
        s = self.settings
        return (
            f"rollouts: the vLLM server at {self.client.url} ({self.server_dtype}), temperature {s.temperature:g}, "
            f"top_p {s.top_p:g}, top_k {s.top_k}, min_p {s.min_p or 0:g}, repetition_penalty "
            f"{s.repetition_penalty:g}, stop ids {self.eos_ids}{extra_sampling(s)}; importance sampling correction "
            f"{self.correction or 'off'}"
        )

    def mark_stale(self, *_: Any) -> None:
        """The policy changed (an optimizer update): send the weights before the next rollout."""
        self.stale = True

    def connect(self) -> None:
        """Wait for the server and open the weight group (rank 0; every rank gets the outcome and the server's
        /health, and raises alike)."""
        s = self.client.settings

        def up() -> dict[str, Any] | None:
            if collectives.rank() != 0:
                return None
            info = self.client.wait_until_up()
            self.group = WeightGroup.open(
                self.client, info, self.device, s.group_port, timeout_s=s.request_timeout, connect_s=s.timeout
            )
            return info

        info = collectives.broadcast_object(
            collectives.run_on_all("connecting to the vLLM server", up, VllmServerError)
        )
        assert info is not None
        self.server_dtype = str(info.get("dtype", "float32"))
        self.check_sampling_fields(info)
        if collectives.rank() == 0:
            logger.info(
                "vLLM server at %s: model %s, %s, weights version %s, weight group %s with its %s worker(s)",
                self.client.url,
                info.get("model"),
                self.server_dtype,
                info.get("weights_version"),
                info.get("weight_backend"),
                info.get("workers"),
            )

    def check_sampling_fields(self, info: dict[str, Any]) -> None:
        """``generation_kwargs`` against the engine's ``SamplingParams`` fields (``info``: its /health answer), before
        the first rollout; every rank reads the same answer, so every rank raises alike.

        Raises:
            ConfigError: a field vLLM's ``SamplingParams`` does not have.
        """
        check_vllm_fields(dict(self.settings.generation_kwargs), info.get("sampling_fields"), self.client.url)

    def sync(self) -> None:
        """Send the policy's weights, then probe that the engine runs them (every rank)."""
        start = time.perf_counter()
        self.version += 1
        counts = push_weights(self.model, self.client, self.group, self.version, self.server_dtype)
        self.check_probe()
        self.stale = False
        self.syncs += 1
        self.last_sync = counts
        self.sync_seconds += time.perf_counter() - start
        add_sync_counts(self.counted, counts)
        if collectives.rank() == 0:
            logger.info(
                "vLLM weights version %d: %d tensors in %d units (%d all-gathers, %d broadcasts of %.3g GB in %s), "
                "probe passed (%.2f s)",
                self.version,
                counts.gather.tensors,
                counts.gather.units,
                counts.gather.collectives,
                counts.broadcasts,
                counts.broadcast_bytes / 1e9,
                self.server_dtype,
                time.perf_counter() - start,
            )

    def _probe_reference(self) -> tuple[list[int], list[int], torch.Tensor, float, int]:
        """The probe's prompt and completion ids, the trainer's log-probs of the completion (a sharded forward on
        every rank), the bound an engine's answer must keep (:func:`probe_bound`) and the layer count it took."""
        from hf_fsdp2.methods.grpo.step import no_grad_logps

        prompt, completion = list(self.probe[0]), list(self.probe[1])
        ids = torch.tensor([prompt + completion])
        row = {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "completion_mask": torch.ones((1, len(completion)), dtype=torch.long),
        }
        mine = no_grad_logps(self.model, row, 1.0, self.device)[0].double().cpu()
        layers = int(getattr(getattr(self.model, "config", None), "num_hidden_layers", 1) or 1)
        return (
            prompt,
            completion,
            mine,
            probe_bound(mine, self.server_dtype, self.compute_dtype, layers),
            layers,
        )

    def check_probe(self) -> float:
        """The largest difference between the server's and the trainer's log-probs of the probe completion (every
        rank computes the trainer's: a sharded forward; rank 0 asks the server).

        Raises:
            VllmServerError: on every rank, when the server answers with another weights version or outside
                :func:`probe_bound`.
        """
        prompt, completion, mine, bound, layers = self._probe_reference()

        def ask() -> float:
            if collectives.rank() != 0:
                return 0.0
            answer = self.client.logprobs(prompt, completion)
            self._check_version(answer, "the probe")
            theirs = torch.tensor(answer["logprobs"], dtype=torch.float64)
            diff = float((theirs - mine).abs().max())
            if not diff <= bound:  # NaN fails too
                raise VllmServerError(
                    f"the vLLM server at {self.client.url} answers with other weights than the trainer's: the probe "
                    f"completion's log-probs differ by up to {diff:.3g} nats (bound {bound:.3g} for {self.server_dtype} "
                    f"vs {self.compute_dtype}, {layers} layers) after weights version {self.version}; was it restarted, or does another "
                    "trainer send it weights? Restart it and the run (it resumes from its last checkpoint)"
                )
            return diff

        return collectives.run_on_all("probing the vLLM server's weights", ask, VllmServerError)  # type: ignore[no-any-return]

    def _check_version(self, answer: dict[str, Any], what: str) -> None:
        got = answer.get("weights_version")
        if got != self.version:
            raise VllmServerError(
                f"the vLLM server at {self.client.url} answered {what} with weights version {got}, not {self.version} "
                "that this trainer sent: it was restarted or another trainer sends it weights; restart it and the "
                "run (it resumes from its last checkpoint)"
            )

    def _ask(
        self,
        prompts: Sequence[Sequence[int]],
        counts: Sequence[int],
        seeds: Sequence[int] | None,
        greedy: bool,
    ) -> tuple[list[list[int]], list[list[float]]]:
        """One engine call (the caller: rank 0 here, each rank in colocate): the completions cut at an end id, and
        their sampling log-probs, prompt after prompt."""
        answer = self.client.generate(prompts, counts, seeds, self.settings, self.eos_ids, greedy)
        self._check_version(answer, "a rollout")
        self.engine_calls += 1
        self.engine_prompts += len(prompts)
        if self.counts_engine:
            self.counted["engine_calls"] += 1
            self.counted["engine_prompts"] += len(prompts)
        ids = [cut_at_eos_list(c, self.eos_ids) for c in answer["completions"]]
        logps = [list(lp[: len(c)]) for lp, c in zip(answer["logprobs"], ids, strict=True)]
        return ids, logps

    def _on_rank0(self, phase: str, fn: Any) -> Any:
        """``fn()`` on rank 0 (its failure raised on every rank), its result on every rank."""
        result = collectives.run_on_all(
            phase, lambda: fn() if collectives.rank() == 0 else None, VllmServerError
        )
        return collectives.broadcast_object(result)

    def generate(
        self, prompts: Sequence[Sequence[int]], *, seed: int, greedy: bool = False
    ) -> list[list[int]]:
        """This rank's completions, one per prompt (every rank calls it, the same number of times; a rank may have
        none): every rank's prompts go to the engine in one call from rank 0, the ``i``-th prompt of rank ``r``
        drawn with seed ``(seed_r x 7919 + i)``. The weights are sent first if the policy changed since the last
        sync."""
        if self.stale:
            self.sync()
        mine = [[int(t) for t in p] for p in prompts]
        everyone = collectives.gather_objects((mine, seed))

        def ask() -> tuple[list[list[int]], list[list[float]]]:
            flat = [p for part, _ in everyone for p in part]
            seeds = [(s * 7_919 + i) % (2**31 - 1) for part, s in everyone for i in range(len(part))]
            return self._ask(flat, [1] * len(flat), None if greedy else seeds, greedy)

        ids, logps = self._on_rank0("generating with the vLLM server", ask)
        start = sum(len(part) for part, _ in everyone[: collectives.rank()])
        share = slice(start, start + len(mine))
        if not greedy:
            self.pending += logps[share]
        return ids[share]  # type: ignore[no-any-return]

    def generate_groups(
        self, prompts: Sequence[Sequence[int]], n: int, share: slice, *, seed: int
    ) -> list[list[int]]:
        """A generation batch's completions ``share`` (this rank's; every rank calls it with the same ``prompts``, the
        batch's unique prompts, and ``n`` completions of each): one engine call from rank 0 with each prompt once
        and ``n`` samples of it, completion ``k`` drawn with seed ``seed + k``; every rank keeps its share."""
        if self.stale:
            self.sync()

        def ask() -> tuple[list[list[int]], list[list[float]]]:
            runs = completion_runs(0, len(prompts) * n, n)
            return self._ask(
                [prompts[j] for j, _, _ in runs],
                [c for _, _, c in runs],
                [seed + k for _, k, _ in runs],
                False,
            )

        ids, logps = self._on_rank0("generating with the vLLM server", ask)
        self.pending += logps[share]
        return ids[share]  # type: ignore[no-any-return]

    def take_logps(self) -> list[list[float]]:
        """The sampling log-probs kept since the last take, then forgotten."""
        out, self.pending = self.pending, []
        return out


def extra_sampling(settings: SamplingSettings) -> str:
    """The start-up line's note of the ``generation_kwargs`` the engine's ``SamplingParams`` also gets."""
    extra = settings.generation_kwargs
    return f", SamplingParams also {', '.join(f'{k} {v}' for k, v in sorted(extra.items()))}" if extra else ""


def cut_at_eos_list(ids: Sequence[int], eos_ids: Sequence[int]) -> list[int]:
    """``ids`` up to and including the first end-of-sequence token (all of them when there is none)."""
    end = next((i + 1 for i, t in enumerate(ids) if t in eos_ids), len(ids))
    return [int(t) for t in ids[:end]]


def build_vllm_generator(
    g: Any,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    tokenizer: Any,
    eos_ids: Sequence[int],
    sampling: SamplingSettings,
    mixed_precision: str,
    device: torch.device,
) -> VllmGenerator:
    """The GRPO recipe's vLLM generator from its keys (``g``: GrpoArgs), connected (every rank waits for the
    server, up to ``vllm_server_timeout``), marked stale by every optimizer update."""
    from hf_fsdp2.methods.grpo.vllm.importance import correction_from_keys, engine_dtype_name

    client = VllmClient(
        ServerSettings(g.vllm_url, g.vllm_server_timeout, g.vllm_request_timeout, g.vllm_group_port)
    )
    correction = correction_from_keys(g)
    compute = engine_dtype_name(model, mixed_precision)
    probe = tuple(tokenizer(text, add_special_tokens=False)["input_ids"] for text in PROBE_TEXT)
    generator = VllmGenerator(
        model,
        client,
        eos_ids=eos_ids,
        settings=sampling,
        probe=probe,  # type: ignore[arg-type]
        compute_dtype=compute,
        device=device,
        correction=correction,
    )
    getattr(optimizer, "optimizer", optimizer).register_step_post_hook(generator.mark_stale)
    generator.connect()
    return generator
