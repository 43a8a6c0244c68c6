"""Preemption: SIGTERM turned into a request, agreed by every rank, to checkpoint and stop."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

from hf_fsdp2 import collectives


class StopRequest:
    """Turns SIGTERM (preemption) into a request to checkpoint and stop at the next step boundary."""

    def __init__(self) -> None:
        self.requested = False
        self.received: float | None = None  # when this rank got the first SIGTERM (time.monotonic)
        self._previous: Callable[..., Any] | int | None = None

    def install(self) -> StopRequest:
        def handler(signum: int, frame: Any) -> None:
            self.requested = True
            if self.received is None:
                self.received = time.monotonic()

        self._previous = signal.signal(signal.SIGTERM, handler)
        return self

    def should_stop(self) -> bool:
        """True on every rank when any rank got SIGTERM (collective: every rank calls it each step)."""
        return not collectives.all_ranks_true(not self.requested)

    def seconds_since(self) -> float:
        """Seconds since the first rank got SIGTERM (collective: every rank calls it once the run stops)."""
        here = time.monotonic() - self.received if self.received is not None else 0.0
        return collectives.all_reduce_max([here])[0]
