"""The hang watchdog: a thread on every rank that names a step that stopped advancing, within minutes instead of the
collective timeout's half hour, and ends the rank so that the elastic agent restarts the run.

Every ``poll_s`` the thread reads where its rank is (:data:`hf_fsdp2.elastic.progress.PROGRESS`) and publishes a
heartbeat to the launch's TCP store. When the current step's watched time passes the bound (``hang_timeout``, or
:data:`~hf_fsdp2.config.restarts.HANG_FACTOR` x the slowest step measured, never below
:data:`~hf_fsdp2.config.restarts.HANG_FLOOR_S`; the first step of an attempt, which compiles, is not watched; checkpoint
saves, evaluation and the export never count), the rank:

1. writes every thread's Python stack (faulthandler) to ``<output_dir>/debug/hang-step<S>-rank<R>.txt`` and its
   stderr, and the flight recorder's record of its last collectives (``TORCH_FR_BUFFER_SIZE``; NCCL's on CUDA) beside
   it;
2. tells the others where it is (in a collective or not, and the innermost frame of its own code) through the store,
   waits a few seconds for theirs, and the lowest rank that answered says which ranks are where, naming those not
   in a collective (the ones the others wait for) and those that did not answer (their last heartbeat);
3. records the hang for the next attempt (:mod:`hf_fsdp2.elastic.attempts`) and exits with :data:`HANG_EXIT`.

A rank stuck in native code that holds the GIL cannot run this thread: faulthandler's own timer, re-armed at every
poll, dumps its stacks and ends it ``GRACE_S`` after the bound; the others, waiting for it, name it as not answering.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

from hf_fsdp2.config.restarts import HANG_FACTOR, HANG_FLOOR_S
from hf_fsdp2.elastic.agent import AgentLaunch
from hf_fsdp2.elastic.attempts import HANG, record_end, with_restart_note
from hf_fsdp2.elastic.progress import PROGRESS, STEP, Progress

HANG_EXIT = 3  # the status of a rank ended by the watchdog (the agent restarts on any non-zero status)
GRACE_S = 30.0  # faulthandler's own deadline after the bound: the others have named the hang by then
ANSWER_S = 10.0  # how long a rank that saw the hang waits for the others' answers
BEAT_S = 5.0  # heartbeat period


def hang_bound(timeout_s: float | None, durations: list[float]) -> float | None:
    """Seconds a watched step may take: ``timeout_s`` when set (0: no watchdog), else HANG_FACTOR x the slowest step
    measured, at least HANG_FLOOR_S; None before any step was measured (the first step of an attempt)."""
    if timeout_s is not None:
        return timeout_s or None
    return max(HANG_FLOOR_S, HANG_FACTOR * max(durations)) if durations else None


def describe_watchdog(timeout_s: float | None) -> str:
    """The start-up log's words for ``hang_timeout``."""
    if timeout_s == 0:
        return "off (hang_timeout=0): a hang waits for the collective timeout (ddp_timeout)"
    bound = (
        f"{timeout_s:g} s (hang_timeout)"
        if timeout_s
        else f"{HANG_FACTOR:g}x the slowest step, at least {HANG_FLOOR_S:g} s (hang_timeout unset)"
    )
    return (
        f"a step that does not finish within {bound} is named a hang from the attempt's second step on (saves, "
        "evaluation and the export do not count); every rank's stack is dumped and the rank ends for a restart"
    )


def _ours(filename: str) -> bool:
    name = filename.replace(os.sep, "/")
    return not ("/torch/" in name or "/threading.py" in name or name.startswith("<"))


def where_in(stack: list[traceback.FrameSummary]) -> tuple[bool, str]:
    """(in a collective, where) of a thread's stack, outermost frame first: whether it waits inside torch.distributed
    below the run's own code (a collective, FSDP2's all-gathers, a wait on their work; the elastic agent's wrapper
    around the whole rank does not count), and where: ``all_reduce in read_step_counts (train/step.py:226)``, or the
    innermost frame of the run's own code, ``_at_step (support/elastic_rank.py:52)``."""
    own = [i for i, f in enumerate(stack) if _ours(f.filename)]
    if not own:
        return False, "?"
    below = stack[own[-1] + 1 :]
    called = [f for f in below if "/torch/distributed/" in f.filename.replace(os.sep, "/")]
    # The caller that says most: past the library's own collectives module, as a lost peer's message names it.
    callers = [
        stack[i]
        for i in own
        if not stack[i].filename.replace(os.sep, "/").endswith("hf_fsdp2/collectives.py")
    ]
    frame = callers[-1] if called and callers else stack[own[-1]]
    at = f"{frame.name} ({'/'.join(Path(frame.filename).parts[-2:])}:{frame.lineno})"
    if not called:
        return False, at
    named = [f for f in called if f.filename.endswith("distributed_c10d.py") and not f.name.startswith("_")]
    return True, f"{(named or called)[-1].name} in {at}"


class Watchdog:
    """The hang watchdog of one rank (:meth:`start` once the process group exists, :meth:`stop` at the end).

    Args:
        timeout_s: ``hang_timeout`` (None: from the step time; 0: no watchdog).
        output_dir: the run folder (the stack dumps go to its ``debug/``).
        rank: this rank.
        world: the ranks.
        progress: where this rank is (the process's :data:`PROGRESS`).
        poll_s: how often the thread looks.
        grace_s: faulthandler's deadline after the bound, for a main thread that holds the GIL.
    """

    def __init__(
        self,
        *,
        timeout_s: float | None,
        output_dir: Path,
        rank: int,
        world: int,
        progress: Progress = PROGRESS,
        poll_s: float = 1.0,
        grace_s: float = GRACE_S,
    ) -> None:
        self.timeout_s, self.output_dir, self.rank, self.world = timeout_s, output_dir, rank, world
        self.progress, self.poll_s, self.grace_s = progress, poll_s, grace_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store: Any = None
        self._main = threading.main_thread().ident
        self._last_beat = 0.0
        self._beats: dict[int, dict[str, Any]] = {}  # the others' last heartbeats, read when a hang is named

    @property
    def enabled(self) -> bool:
        return self.timeout_s != 0

    def start(self) -> Watchdog:
        """Connect to the launch's store (the ranks' meeting point; none: this rank alone) and start the thread."""
        if not self.enabled:
            return self
        self._store = _store(AgentLaunch.from_env().attempt) if self.world > 1 else None
        # Where NCCL's flight recorder dumps on its own timeout (TORCH_FR_DUMP_TEMP_FILE): on every node.
        with contextlib.suppress(OSError):
            (self.output_dir / "debug").mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._run, name="hf_fsdp2-hang-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self.enabled:
            faulthandler.cancel_dump_traceback_later()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            step, phase, watched = self.progress.snapshot()
            self._beat(step, phase)
            bound = hang_bound(self.timeout_s, list(self.progress.durations))
            if phase != STEP or bound is None or step <= self.progress.first_step:
                faulthandler.cancel_dump_traceback_later()
                continue
            if watched > bound:
                self._hang(step, watched, bound)
                return
            # The backstop for a main thread that holds the GIL (this thread then never runs again).
            out = _stderr()
            if out is not None:
                faulthandler.dump_traceback_later(bound - watched + self.grace_s, exit=True, file=out)

    def _beat(self, step: int, phase: str) -> None:
        now = time.time()
        if self._store is None or now - self._last_beat < BEAT_S:
            return
        self._last_beat = now
        try:
            self._store.set(f"beat/{self.rank}", json.dumps({"step": step, "phase": phase, "time": now}))
        except Exception:  # the store's host may be gone: a heartbeat is never worth failing the rank
            self._store = None

    def _hang(self, step: int, watched: float, bound: float) -> None:
        # From here the rank ends through this thread: a failure the hang causes in the main thread (a peer that
        # left first breaks its collective) waits for it (wait_while_a_hang_is_named) instead of ending the rank.
        self.progress.hang_named.set()
        frame = sys._current_frames().get(self._main or 0)
        stack = traceback.extract_stack(frame) if frame is not None else []
        collective, where = where_in(stack)
        debug = self.output_dir / "debug"
        files = _dump(debug, step, self.rank)
        mine = {
            "rank": self.rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "collective": collective,
            "where": where,
            "watched": round(watched, 1),
            "time": time.time(),
        }
        answers = self._exchange(mine)
        bounded = (
            f"hang_timeout {bound:g} s"
            if self.timeout_s
            else f"the bound {bound:.0f} s: {HANG_FACTOR:g}x the slowest step, at least {HANG_FLOOR_S:g} s"
        )
        message = hang_message(step, bounded, answers, debug, beats=self._beats)
        culprits = [r for r, a in answers.items() if a is not None and not a.get("collective")]
        culprits += [r for r, a in answers.items() if a is None]
        record_end(HANG, message, gone=sorted(culprits) or [self.rank], where=where)
        if self._first_to_say():
            text = with_restart_note(message, AgentLaunch.from_env(), self.output_dir)
            sys.stderr.write(f"hf_fsdp2 error: {text}\n")
        sys.stderr.write(
            f"hf_fsdp2: rank {self.rank} hung at step {step} in {where}; stacks: {', '.join(files)}\n"
        )
        sys.stderr.flush()
        self._leave_together([r for r, a in answers.items() if a is not None])
        os._exit(HANG_EXIT)

    def _first_to_say(self) -> bool:
        """One rank says the hang line: the first whose answers are in (every rank, when the store is gone)."""
        try:
            return self._store is None or int(self._store.add("hang/said", 1)) == 1
        except Exception:
            return True

    def _leave_together(self, ranks: list[int]) -> None:
        """Wait (at most ANSWER_S) until every rank that answered has recorded the hang: a rank that left first
        would end the others' collectives, and the launcher stop them, before their records are written."""
        store = self._store
        if store is None:
            return
        try:
            store.set(f"hang/done/{self.rank}", "1")
            deadline = time.monotonic() + ANSWER_S
            while time.monotonic() < deadline and not store.check([f"hang/done/{r}" for r in ranks]):
                time.sleep(0.1)
        except Exception:
            pass

    def _exchange(self, mine: dict[str, Any]) -> dict[int, dict[str, Any] | None]:
        """This rank's answer to the store, then every rank's (None: no answer within ANSWER_S; then its last
        heartbeat, when it has one, under ``beat``)."""
        answers: dict[int, dict[str, Any] | None] = {r: None for r in range(self.world)}
        answers[self.rank] = mine
        store = self._store
        if store is None:
            return answers
        try:
            store.set(f"hang/{self.rank}", json.dumps(mine))
            deadline = time.monotonic() + ANSWER_S
            while time.monotonic() < deadline:
                if store.check([f"hang/{r}" for r in range(self.world)]):
                    break
                time.sleep(0.2)
            for r in range(self.world):
                if r != self.rank and store.check([f"hang/{r}"]):
                    answers[r] = json.loads(store.get(f"hang/{r}"))
                elif r != self.rank and store.check([f"beat/{r}"]):
                    self._beats[r] = json.loads(store.get(f"beat/{r}"))
        except Exception:  # the store's host is gone: what this rank knows
            pass
        return answers


def wait_while_a_hang_is_named(progress: Progress = PROGRESS) -> None:
    """On a failure of the main thread: when the watchdog is naming a hang, wait for it to end the rank (its status,
    its record); returns at once otherwise."""
    if progress.hang_named.is_set():
        time.sleep(3 * ANSWER_S)


def hang_message(
    step: int,
    bound: str,
    answers: dict[int, dict[str, Any] | None],
    debug: Path,
    beats: dict[int, dict[str, Any]] | None = None,
) -> str:
    """The one line that names the hang: where each rank is (a rank that did not answer: its last heartbeat), and the
    ranks the others wait for."""
    waiting = [r for r, a in answers.items() if a is not None and a.get("collective")]
    stuck = [r for r, a in answers.items() if a is not None and not a.get("collective")]
    silent = [r for r, a in answers.items() if a is None]
    watched = max((a["watched"] for a in answers.values() if a is not None), default=0.0)
    parts = []
    for r, a in sorted(answers.items()):
        if a is None:
            beat = (beats or {}).get(r)
            last = (
                f"; its last heartbeat {time.time() - beat['time']:.0f} s ago, at step {beat['step']}"
                if beat
                else ""
            )
            parts.append(
                f"rank {r}: no answer (stuck in native code holding the GIL, stopped, or its machine lost{last})"
            )
        elif a.get("collective"):
            parts.append(f"rank {r} ({a['host']}) waits in a collective: {a['where']}")
        else:
            parts.append(f"rank {r} ({a['host']}) is not in a collective: {a['where']}")
    culprits = stuck + silent
    blame = (
        f"; the others wait for {'rank ' + str(culprits[0]) if len(culprits) == 1 else 'ranks ' + ', '.join(map(str, culprits))}"
        if culprits and waiting
        else ""
    )
    return (
        f"hang at step {step}: no step finished for {watched:.1f} s ({bound}): "
        + "; ".join(parts)
        + blame
        + f". Every rank's Python stack (and its last collectives: fr_trace) is in {debug}/hang-step{step}-rank<r>.txt"
    )


def _dump(debug: Path, step: int, rank: int) -> list[str]:
    """Every thread's stack (faulthandler) to a file and stderr, and the flight recorder's collectives beside it."""
    written = []
    try:
        debug.mkdir(parents=True, exist_ok=True)
        path = debug / f"hang-step{step}-rank{rank}.txt"
        with open(path, "w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        written.append(str(path))
        out = _stderr()
        if out is not None:
            faulthandler.dump_traceback(file=out, all_threads=True)
        trace = flight_recorder_trace()
        if trace:
            (debug / f"hang-step{step}-rank{rank}.fr_trace.pkl").write_bytes(trace)
            written.append(str(debug / f"hang-step{step}-rank{rank}.fr_trace.pkl"))
    except OSError as err:
        sys.stderr.write(f"hf_fsdp2: could not write the hang's stacks to {debug}: {err}\n")
    return written


def _stderr() -> Any:
    """The process's own stderr for faulthandler, which writes to a file descriptor (None when it has none: a
    notebook, a test's capture)."""
    for out in (sys.stderr, sys.__stderr__):
        try:
            if out is not None:
                out.fileno()
                return out
        except (OSError, ValueError, AttributeError):
            continue
    return None


def flight_recorder_trace() -> bytes | None:
    """The flight recorder's record of this rank's last collectives (NCCL's on CUDA: which collective each rank
    entered, its sequence number and sizes; recorded when ``TORCH_FR_BUFFER_SIZE`` is set before the process group,
    as :func:`flight_recorder_env` does), or None where this torch has none."""
    import torch

    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)
    if dump is None:
        return None
    try:
        return bytes(dump(True, True, False))
    except Exception:
        return None


FR_BUFFER = "2000"  # entries of the flight recorder's ring buffer (torch's debugging guides use 2000)


def flight_recorder_env(debug_dir: Path, env: dict[str, str] | Any = None) -> list[str]:
    """Turn the flight recorder on for the hang watchdog's dump (before the process group exists): its buffer, and on
    CUDA NCCL's own dump on its timeout into ``debug_dir``; a variable the environment sets keeps its value. Returns
    ``NAME=value`` of what it set."""
    env = os.environ if env is None else env
    set_here = []
    wanted = {
        "TORCH_FR_BUFFER_SIZE": FR_BUFFER,
        # NCCL's own watchdog (its collective timeout) dumps the same record, on CUDA.
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(Path(debug_dir) / "nccl_trace_rank_"),
    }
    for name, value in wanted.items():
        if name not in env:
            env[name] = value
            set_here.append(f"{name}={value}")
    return set_here


def _store(attempt: int) -> Any:
    """A client of the launch's TCP store (MASTER_ADDR:MASTER_PORT: the agent's, or rank 0's), under this
    attempt's own prefix; None without one."""
    import torch.distributed as dist

    try:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            None,
            False,
            timedelta(seconds=30),
        )
    except Exception:
        return None
    return dist.PrefixStore(f"/hf_fsdp2/watchdog/attempt_{attempt}", store)
