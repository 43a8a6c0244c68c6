"""Where this rank is in the run: the step it is on, what it is doing, and since when (process state, as a signal
handler is: one run per process).

The loop marks each step's start (:func:`begin_step`); a checkpoint save, an evaluation or the export marks its span
as unwatched (:func:`unwatched`: they can be long, and a hang there is not a step that stopped advancing). The hang
watchdog (:mod:`hf_fsdp2.elastic.watchdog`) reads it from its own thread, and a rank that fails records it
(:mod:`hf_fsdp2.elastic.attempts`). Not collective.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

STEP = "step"
START_UP = "start-up"


@dataclass(kw_only=True)
class Progress:
    """This rank's place in the run (one per process: :data:`PROGRESS`)."""

    output_dir: Path | None = None
    # The first step of this attempt: it compiles and warms up, and is never watched.
    first_step: int = 0
    # The step begun last (0: none yet), and what the rank does: STEP, or an unwatched span ("checkpoint save", ...).
    step: int = 0
    phase: str = START_UP
    # When the watched time of this step began, and the watched seconds of each finished step of this attempt.
    since: float = field(default_factory=time.monotonic)
    durations: list[float] = field(default_factory=list)
    # The unwatched span an error came out of (a failing rank records it, not the step around it).
    failed_in: str | None = None
    # Set by the hang watchdog as it names a hang: it ends the rank, not the main thread's failure.
    hang_named: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self, output_dir: Path | None = None) -> None:
        """A new run in this process (its folder, once it is owned)."""
        with self._lock:
            self.output_dir, self.first_step, self.step, self.phase = output_dir, 0, 0, START_UP
            self.failed_in = None
            self.hang_named.clear()
            self.since, self.durations = time.monotonic(), []

    def begin_step(self, step: int) -> None:
        """Step ``step`` begins: the previous one's watched time is measured (every rank, at the loop's top)."""
        now = time.monotonic()
        with self._lock:
            if self.step:
                self.durations.append(now - self.since)
            else:
                self.first_step = step
            self.step, self.phase, self.since = step, STEP, now

    @property
    def completed(self) -> int:
        """The last step this rank finished (the one begun last is still running while its phase is STEP)."""
        if not self.step:
            return 0
        return self.step if self.phase not in (STEP, START_UP) else self.step - 1

    def where(self) -> str:
        """What this rank was doing: the step's work, or the unwatched span an error came out of."""
        return self.failed_in or self.phase

    def snapshot(self) -> tuple[int, str, float]:
        """(step, phase, watched seconds of the current step so far), read together."""
        with self._lock:
            watched = time.monotonic() - self.since if self.phase == STEP else 0.0
            return self.step, self.phase, watched

    @contextmanager
    def unwatched(self, what: str) -> Iterator[None]:
        """A span that is not a step's work (a checkpoint save, an evaluation, the export): never named a hang, and
        left out of the step's measured time."""
        with self._lock:
            outer, self.phase = self.phase, what
            start = time.monotonic()
        try:
            yield
        except BaseException:
            self.failed_in = self.failed_in or what
            raise
        finally:
            with self._lock:
                self.phase = outer
                self.since += time.monotonic() - start  # the step's watched clock resumes where it stopped


PROGRESS = Progress()
"""This process's run."""
