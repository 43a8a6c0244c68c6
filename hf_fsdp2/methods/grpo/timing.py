"""The rollout's own clock: :class:`TimedGenerator` wraps a generation backend (the
:class:`~.rollout.Generator` protocol) and counts the seconds spent in its ``generate`` calls and the completion tokens
they returned, so a run logs generation tokens/s beside the meter's step time and training tokens/s, for
transformers' ``generate`` and for the vLLM server alike. The vLLM client's weight sync (sent inside the first
``generate`` after an update) is counted apart, so generation tokens/s is the sampling speed of each backend."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from hf_fsdp2 import collectives

ROLLOUT_METRICS = (
    "rollout/generate_s",
    "rollout/weight_sync_s",
    "rollout/completion_tokens",
    "rollout/tokens_per_s",
)
"""What :meth:`TimedGenerator.rollout_metrics` logs, for the steps since the last logged one: the seconds spent generating
(the slowest rank's, the weight sync left out), the seconds spent sending weights to a vLLM server (0 without one),
the completion tokens sampled on every rank, and their ratio (generation tokens/s of the whole run)."""
VLLM_COUNTS = (
    "rollout/engine_calls",
    "rollout/engine_prompts",
    "rollout/sync_all_gathers",
    "rollout/sync_gathered_bytes",
    "rollout/sync_broadcast_bytes",
    "rollout/sync_host_bytes",
)
"""What a vLLM backend adds (its ``counted`` totals, for the steps since the last logged one): the engine calls and the
prompts handed to the engines (every engine's), and per rank the weight updates' all-gathers, their bytes, the bytes
rank 0 broadcast to the server, and the host bytes copied (the largest rank's): docs/grpo.md's counts beside the
seconds."""


class TimedGenerator:
    """``inner`` with a clock around ``generate``; every other attribute is ``inner``'s (``eos_ids``,
    ``take_logps``, ``correction``, ``describe``...), so the stepper sees the same backend."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seconds, self.tokens, self.calls = 0.0, 0, 0
        self._sync_seen = self._sync_total()
        self._counted_seen: dict[str, float] = {}
        if hasattr(inner, "generate_groups"):  # a vLLM backend's whole-batch call, timed alike
            self.generate_groups = self._timed_groups

    def _timed_groups(
        self, prompts: Sequence[Sequence[int]], n: int, share: slice, *, seed: int
    ) -> list[list[int]]:
        start = time.perf_counter()
        out = self.inner.generate_groups(prompts, n, share, seed=seed)
        self._count(start, out)
        return list(out)

    def _count(self, start: float, out: Sequence[Sequence[int]]) -> None:
        self.seconds += time.perf_counter() - start
        self.tokens += sum(len(c) for c in out)
        self.calls += 1

    def __getattr__(self, name: str) -> Any:
        # Only reached for names this wrapper does not define: the backend's own attributes.
        if name == "inner":  # not yet set (copy/pickle build the object without __init__): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _sync_total(self) -> float:
        """The backend's weight-sync seconds so far (VllmGenerator.sync_seconds; 0 for transformers)."""
        return float(getattr(self.inner, "sync_seconds", 0.0))

    def generate(
        self, prompts: Sequence[Sequence[int]], *, seed: int, greedy: bool = False
    ) -> list[list[int]]:
        """The backend's completions, timed; their tokens counted."""
        start = time.perf_counter()
        out = self.inner.generate(prompts, seed=seed, greedy=greedy)
        self._count(start, out)
        return list(out)

    def rollout_metrics(self, device: torch.device) -> dict[str, float]:
        """:data:`ROLLOUT_METRICS` since the last call, then the counters start again (collective: every rank calls
        it, as the step's other metrics). Ranks generate side by side, so the run's rollout time is the slowest
        rank's and its tokens are every rank's. ``device``: where the backend's collectives take tensors."""
        sync = self._sync_total() - self._sync_seen
        generating = max(self.seconds - sync, 0.0)
        count = torch.tensor([float(self.tokens)], dtype=torch.float64, device=device)
        tokens = float(collectives.all_reduce_sum(count).item())
        wall, sync_wall = collectives.all_reduce_max([generating, sync])
        self.seconds, self.tokens, self.calls = 0.0, 0, 0
        self._sync_seen = self._sync_total()
        out = {
            "rollout/generate_s": wall,
            "rollout/weight_sync_s": sync_wall,
            "rollout/completion_tokens": tokens,
            "rollout/tokens_per_s": tokens / wall if wall > 0 else math.nan,
        }
        counted = getattr(self.inner, "counted", None)
        if counted is not None:  # a vLLM backend (every rank's is one): its counts since the last call
            delta = [counted[k] - self._counted_seen.get(k, 0.0) for k in counted]
            self._counted_seen = dict(counted)
            engines = collectives.all_reduce_sum(torch.tensor(delta[:2], dtype=torch.float64, device=device))
            per_rank = collectives.all_reduce_max(delta[2:])
            out.update(zip(VLLM_COUNTS, [float(v) for v in engines.cpu()] + per_rank, strict=True))
        return out
