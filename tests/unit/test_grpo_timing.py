"""The rollout's clock (hf_fsdp2/methods/grpo/timing.py): generation seconds and tokens of the steps
since the last log, the vLLM weight sync counted apart, every other attribute the backend's; and the step's metrics
carry them (rollout/* in metrics.jsonl, what scripts/demo.sh --grpo [--vllm] reports)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import pytest
import torch

from hf_fsdp2.methods.grpo.metrics import STATS, GrpoStepMetrics, Rollout
from hf_fsdp2.methods.grpo.timing import ROLLOUT_METRICS, VLLM_COUNTS, TimedGenerator


class SlowBackend:
    """Sleeps ``per_call`` seconds per generate; the first call after ``mark_stale`` also 'sends weights' for
    ``sync`` seconds, counted in ``sync_seconds`` as VllmGenerator does."""

    def __init__(self, per_call: float, sync: float = 0.0) -> None:
        self.eos_ids = [2]
        self.per_call, self.sync, self.stale, self.sync_seconds = per_call, sync, sync > 0, 0.0
        self.kept: list[list[float]] = []

    def mark_stale(self) -> None:
        self.stale = self.sync > 0

    def generate(
        self, prompts: Sequence[Sequence[int]], *, seed: int, greedy: bool = False
    ) -> list[list[int]]:
        if self.stale:
            time.sleep(self.sync)
            self.sync_seconds += self.sync
            self.stale = False
        time.sleep(self.per_call)
        self.kept += [[-0.5] * (len(p) + seed) for p in prompts]
        return [[7] * (len(p) + seed) + [2] for p in prompts]

    def take_logps(self) -> list[list[float]]:
        out, self.kept = self.kept, []
        return out


def test_counts_generation_seconds_and_tokens_since_the_last_read_without_the_weight_sync() -> None:
    backend = SlowBackend(per_call=0.05, sync=0.2)
    gen = TimedGenerator(backend)
    start = time.perf_counter()
    first = gen.generate([[1, 5], [1, 5, 6]], seed=1)  # syncs first: 0.2 s not counted as generating
    second = gen.generate([[1]], seed=0)
    wall = time.perf_counter() - start
    assert first == [[7, 7, 7, 2], [7, 7, 7, 7, 2]] and second == [
        [7, 2]
    ]  # the backend's completions, unchanged
    got = gen.rollout_metrics(torch.device("cpu"))
    assert set(got) == set(ROLLOUT_METRICS)
    assert got["rollout/completion_tokens"] == 4 + 5 + 2
    assert got["rollout/weight_sync_s"] == pytest.approx(0.2)
    assert 0.1 <= got["rollout/generate_s"] <= wall - 0.2 + 1e-6  # two calls of >= 0.05 s each, sync left out
    assert got["rollout/tokens_per_s"] == pytest.approx(11 / got["rollout/generate_s"])
    # The counters start again: the next interval has only what came after.
    backend.mark_stale()
    gen.generate([[1, 2, 3]], seed=0)
    again = gen.rollout_metrics(torch.device("cpu"))
    assert again["rollout/completion_tokens"] == 4 and again["rollout/weight_sync_s"] == pytest.approx(0.2)
    assert 0.05 <= again["rollout/generate_s"] < 0.2
    empty = gen.rollout_metrics(torch.device("cpu"))  # no rollout in the interval (steps_per_generation > 1)
    assert empty["rollout/completion_tokens"] == 0 and empty["rollout/generate_s"] == 0.0
    assert math.isnan(empty["rollout/tokens_per_s"])


def test_the_stepper_sees_the_backend_through_the_wrapper() -> None:
    backend = SlowBackend(per_call=0.0)
    gen = TimedGenerator(backend)
    assert gen.eos_ids == [2]  # what rollout() and the clipped count read
    gen.generate([[1, 2]], seed=1)
    assert gen.take_logps() == [[-0.5, -0.5, -0.5]]  # vLLM's sampling log-probs reach the correction
    assert getattr(gen, "correction", None) is None  # transformers: no importance sampling correction
    with pytest.raises(AttributeError, match="no_such"):
        gen.no_such  # noqa: B018


def test_the_step_metrics_carry_the_rollout_timing() -> None:
    gen = TimedGenerator(SlowBackend(per_call=0.01))
    gen.generate([[1, 2], [1, 2]], seed=0)
    roll = Rollout(
        rows=[],
        rewards=torch.tensor([1.0, 0.0]),
        per_function=torch.tensor([[1.0], [0.0]]),
        advantages=torch.tensor([0.5, -0.5]),
        zero_std=torch.tensor([0.0, 0.0]),
        lengths=[3, 3],
        completions=["a", "b"],
        prompts=["p", "p"],
    )
    out = GrpoStepMetrics(
        stats=torch.zeros(len(STATS)),
        roll=roll,
        function_names=["f"],
        beta=0.0,
        device=torch.device("cpu"),
        timing=gen.rollout_metrics,
    )
    metrics = out(1)
    assert metrics["rollout/completion_tokens"] == 6 and metrics["rollout/generate_s"] >= 0.01
    assert metrics["reward"] == pytest.approx(0.5)  # the step's own metrics are still there
    plain = GrpoStepMetrics(
        stats=torch.zeros(len(STATS)), roll=roll, function_names=["f"], beta=0.0, device=torch.device("cpu")
    )
    assert not any(k.startswith("rollout/") for k in plain(1))


def test_a_vllm_backends_counts_are_logged_beside_the_seconds() -> None:
    """A backend with running ``counted`` totals (the vLLM generators): each read logs what was added since the last
    one, under rollout/engine_* and rollout/sync_*; transformers' backend logs none of them."""
    backend = SlowBackend(per_call=0.0)
    backend.counted = dict.fromkeys(  # type: ignore[attr-defined]
        ("engine_calls", "engine_prompts", "all_gathers", "gathered_bytes", "broadcast_bytes", "host_bytes"),
        0.0,
    )
    gen = TimedGenerator(backend)
    backend.counted.update(
        engine_calls=1, engine_prompts=3, all_gathers=5, gathered_bytes=100, broadcast_bytes=100
    )  # type: ignore[attr-defined]
    first = gen.rollout_metrics(torch.device("cpu"))
    assert set(first) == set(ROLLOUT_METRICS) | set(VLLM_COUNTS)
    assert [first[k] for k in VLLM_COUNTS] == [1, 3, 5, 100, 100, 0]
    backend.counted["engine_calls"] += 1  # type: ignore[attr-defined]
    again = gen.rollout_metrics(torch.device("cpu"))
    assert [again[k] for k in VLLM_COUNTS] == [1, 0, 0, 0, 0, 0]
    assert set(TimedGenerator(SlowBackend(per_call=0.0)).rollout_metrics(torch.device("cpu"))) == set(
        ROLLOUT_METRICS
    )
