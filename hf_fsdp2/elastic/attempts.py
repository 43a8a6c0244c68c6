"""How each attempt of a run ended, and the run's restarts: the record a failing rank leaves, what the next attempt
makes of it (which rank, which error or signal, at which step, how many steps were lost), ``restarts.json``, and
the plain words when a failure repeats at the same step.

A rank that fails in a way it can see (an error of its own, a lost peer, a hang) writes
``<output_dir>/.hf_fsdp2_attempt/rank<r>.json`` before it leaves; a rank killed by a signal writes nothing, and the
ranks that lose it name it. The next attempt's rank 0 reads those records, appends one entry to
``<output_dir>/restarts.json`` (the run's history of restarts, which summary.json and the model card report) and
removes them. Not collective.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hf_fsdp2.checkpoint.layout import ATTEMPT_DIR, RESTARTS_FILE
from hf_fsdp2.elastic.agent import AgentLaunch
from hf_fsdp2.elastic.progress import PROGRESS, START_UP, STEP

logger = logging.getLogger("hf_fsdp2")

# Why a rank ended, as its record says.
ERROR, LOST, HANG = "error", "lost", "hang"
_SIGNALLED = (
    "ended without an error of its own: killed by a signal (kill -9, the out-of-memory killer: dmesg says 'Out of "
    "memory'), or a crash in native code"
)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def record_end(kind: str, message: str, *, gone: Sequence[int] = (), where: str = "") -> None:
    """This rank ends on a failure: its record in the run folder, for the attempt that follows (written atomically;
    nothing when no run folder is owned yet; never raises: the rank is leaving with its own error)."""
    out = PROGRESS.output_dir
    if out is None:
        return
    step, phase = PROGRESS.step, PROGRESS.where()
    record = {
        "rank": _rank(),
        "attempt": AgentLaunch.from_env().attempt,
        "host": socket.gethostname(),
        "step": step,
        "completed": step if phase != STEP and step else PROGRESS.completed,
        "phase": phase,
        "kind": kind,
        "message": message.strip().splitlines()[0][:2000] if message.strip() else "",
        "gone": list(gone),
        "where": where,
    }
    try:
        folder = out / ATTEMPT_DIR
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".rank{_rank()}.tmp"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, folder / f"rank{_rank()}.json")
    except OSError as err:
        logger.debug("could not record how this rank ended: %s", err)


def read_ends(output_dir: Path) -> list[dict[str, Any]]:
    """The records of the ranks of the previous attempt that saw themselves fail, by rank."""
    found = []
    for path in sorted((Path(output_dir) / ATTEMPT_DIR).glob("rank*.json")):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(found, key=lambda r: int(r.get("rank", 0)))


def lost_only(output_dir: Path, *, since: float) -> set[int]:
    """The ranks whose record, written since ``since`` (this launch), says they ended on losing another rank: never
    the cause of their attempt's end (for the launcher's line, whose failures all look alike: exit status 1)."""
    lost = set()
    for path in (Path(output_dir) / ATTEMPT_DIR).glob("rank*.json"):
        try:
            if path.stat().st_mtime >= since and json.loads(path.read_text()).get("kind") == LOST:
                lost.add(int(path.stem.removeprefix("rank")))
        except (OSError, ValueError):
            continue
    return lost


def _ranks(ranks: Sequence[int]) -> str:
    ranks = sorted(set(ranks))
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


def describe_end(ends: Sequence[dict[str, Any]], world: int) -> tuple[str, list[int], str]:
    """(cause in one line, the ranks it names, its kind) of an attempt from its ranks' records."""
    by_kind = {k: [e for e in ends if e.get("kind") == k] for k in (HANG, ERROR, LOST)}
    if by_kind[HANG]:
        report = by_kind[HANG][0]
        return report["message"], list(report.get("gone") or [report["rank"]]), HANG
    if by_kind[ERROR]:
        errors = by_kind[ERROR]
        messages = {e["message"] for e in errors}
        ranks = [int(e["rank"]) for e in errors]
        if len(messages) == 1:
            who = "every rank" if len(ranks) == world and world > 1 else _ranks(ranks)
            return f"{who}: {errors[0]['message']}", ranks, ERROR
        return "; ".join(f"rank {e['rank']}: {e['message']}" for e in errors), ranks, ERROR
    if by_kind[LOST]:
        lost = by_kind[LOST]
        gone = sorted({int(r) for e in lost for r in e.get("gone") or []})
        where = next((e["where"] for e in lost if e.get("where")), "")
        during = f" during {where}" if where else ""
        seen = _ranks([int(e["rank"]) for e in lost])
        if gone:
            return f"{_ranks(gone)} {_SIGNALLED}; {seen} lost it{during}", gone, LOST
        return (
            f"a rank on another machine ended ({seen} lost its connection{during}): killed by a signal, a crash, or "
            "its machine was lost",
            [],
            LOST,
        )
    return (
        "no rank recorded why: every rank was killed by a signal or its machine was lost (the launcher's log gives "
        "each rank's exit status)",
        [],
        "unknown",
    )


def read_history(output_dir: Path) -> list[dict[str, Any]]:
    """The run's restarts so far (``restarts.json``), oldest first; empty when it has had none."""
    path = Path(output_dir) / RESTARTS_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return list(data.get("restarts", [])) if isinstance(data, dict) else []


def take_previous(
    output_dir: Path, *, launch: AgentLaunch, resumed_step: int, last_logged_step: int, world: int
) -> dict[str, Any] | None:
    """Rank 0, at the start of an attempt: how the previous attempt ended, appended to ``restarts.json`` (its
    records then removed); None when this attempt follows no failure (a first attempt with no records)."""
    out = Path(output_dir)
    ends = read_ends(out)
    if not ends and launch.attempt == 0:
        return None
    cause, ranks, kind = describe_end(ends, world)
    reached = max([int(e.get("completed", 0)) for e in ends] + [last_logged_step])
    on = max((int(e.get("step", 0)) for e in ends), default=0)
    phase = next((e["phase"] for e in ends if int(e.get("step", 0)) == on), "")
    entry = {
        "restart": launch.attempt if launch.attempt else None,
        "launch": "restart" if launch.attempt else "new launch",
        "step": on or None,
        "phase": phase or None,
        "kind": kind,
        "ranks": ranks,
        "cause": cause,
        "resumed_from_step": resumed_step or None,
        "steps_lost": max(reached - resumed_step, 0),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    history = [*read_history(out), entry]
    tmp = out / f".{RESTARTS_FILE}.tmp"
    tmp.write_text(json.dumps({"restarts": history}, indent=2) + "\n")
    os.replace(tmp, out / RESTARTS_FILE)
    shutil.rmtree(out / ATTEMPT_DIR, ignore_errors=True)
    return entry


def _same_failure(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.get("step") is not None and (a.get("step"), a.get("phase")) == (b.get("step"), b.get("phase"))


def repeated(history: Sequence[dict[str, Any]]) -> int:
    """How many of the latest restarts in a row followed a failure at the same step, in the same part of it (1: the
    last one alone)."""
    if not history:
        return 0
    n = 1
    while n < len(history) and _same_failure(history[-n - 1], history[-1]):
        n += 1
    return n


def when(step: int | None, phase: str | None) -> str:
    """``during step 3``, ``in the checkpoint save after step 4``, ``before its first step``."""
    if not step or phase == START_UP:
        return "before its first step"
    return f"during step {step}" if phase in (STEP, None) else f"in the {phase} after step {step}"


def describe_restart(entry: dict[str, Any], history: Sequence[dict[str, Any]], launch: AgentLaunch) -> str:
    """The log line of a restart (its cause, the steps lost, where it resumes) and, when the failure repeats at the
    same step, that it does."""
    at = when(entry.get("step"), entry.get("phase"))
    resumed = (
        f"resuming from checkpoint-{entry['resumed_from_step']}"
        if entry.get("resumed_from_step")
        else "starting over"
    )
    what = (
        f"restart {launch.attempt} of {launch.max_restarts}"
        if launch.attempt
        else "a new launch after a failure"
    )
    line = f"{what}: the previous attempt ended {at}: {entry['cause']}; {resumed}, {entry['steps_lost']} step(s) lost"
    n = repeated(history)
    if n >= 2:
        line += (
            f". The last {n} attempts all ended at step {entry['step']}: a failure at the same step each time is not "
            f"transient, and a restart will not get past it ({launch.restarts_left} restart(s) left)"
        )
    return line


def with_restart_note(message: str, launch: AgentLaunch, output_dir: Path | None) -> str:
    """A failing rank's error line with what happens next under restarts: the launcher restarts the run (how many
    restarts are left), or none is left; then whether every attempt ended at the same step, said plainly. The message
    unchanged for a run without restarts."""
    if not launch.under_agent or launch.max_restarts == 0:
        return message
    message = message.rstrip()
    message += "" if message.endswith(".") else "."
    if launch.restarts_left > 0:
        return (
            f"{message} The launcher restarts the run ({launch.restarts_left} of max_restarts {launch.max_restarts} "
            "restart(s) left): it resumes from its newest checkpoint by itself."
        )
    history = read_history(output_dir) if output_dir is not None else []
    earlier = (
        [h for h in history if h.get("launch") == "restart"][-launch.attempt :] if launch.attempt else []
    )
    steps = [int(h.get("step") or 0) for h in earlier] + [PROGRESS.step]
    attempts = f"{launch.max_restarts + 1} attempts (max_restarts {launch.max_restarts})"
    # Said here as well as in restarts.json: the launcher's own report names the rank it saw end first, which is
    # often a rank that only lost the failing one, without the failing rank's error.
    before = (
        f" (the previous attempt's cause: {earlier[-1]['cause']})"
        if earlier and earlier[-1].get("cause")
        else ""
    )
    if len(set(steps)) == 1:
        return (
            f"{message} No restart is left: all {attempts} ended {when(steps[0], STEP)}, so the failure is not "
            f"transient and another restart would end there too{before}. Fix its cause (restarts.json in the run "
            "folder lists each attempt's), then run the same command again: it resumes from the newest checkpoint."
        )
    return (
        f"{message} No restart is left: the {attempts} ended at steps {', '.join(str(s) for s in steps)}{before} "
        "(restarts.json in the run folder lists each cause); run the same command again to continue from the "
        "newest checkpoint."
    )


LAYOUT_FILE = "nodes.json"


def clear_attempt(output_dir: Path) -> None:
    """Rank 0, at the end of a finished run: the attempt's records (its nodes) go."""
    shutil.rmtree(Path(output_dir) / ATTEMPT_DIR, ignore_errors=True)


def rank_place() -> dict[str, Any]:
    """This rank's place in the launch: its node (the agent's group rank), host and address (gathered by rank 0 at
    start, so that a node that never comes back can be named)."""
    host = socket.gethostname()
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        addr = ""
    return {"rank": _rank(), "node": int(os.environ.get("GROUP_RANK", "0")), "host": host, "addr": addr}


def record_layout(output_dir: Path, places: Sequence[dict[str, Any]]) -> None:
    """Rank 0: every rank's place in this attempt, beside the attempt's end records (never raises)."""
    try:
        folder = Path(output_dir) / ATTEMPT_DIR
        folder.mkdir(parents=True, exist_ok=True)
        (folder / LAYOUT_FILE).write_text(json.dumps(list(places)))
    except OSError as err:
        logger.debug("could not record the ranks' nodes: %s", err)


def read_layout(output_dir: Path) -> list[dict[str, Any]]:
    """Every rank's place in the last attempt that got to its first step (empty: none recorded)."""
    try:
        places = json.loads((Path(output_dir) / ATTEMPT_DIR / LAYOUT_FILE).read_text())
    except (OSError, ValueError):
        return []
    return places if isinstance(places, list) else []


def lost_nodes(output_dir: Path, this_node: int) -> str:
    """For a launcher whose rendezvous timed out: which node of the last attempt did not come back and how it was
    lost, from the attempt's records (the ranks the survivors lost, by process or by address; else every node but
    this one)."""
    places = read_layout(output_dir)
    if not places:
        return "the run folder holds no record of the last attempt's nodes"
    ends = read_ends(Path(output_dir))
    by_rank = {int(p["rank"]): p for p in places}
    gone = {int(r) for e in ends for r in e.get("gone") or []}
    # A rank on another machine: the transport's error names its address.
    messages = " ".join(e.get("message", "") + " " + e.get("where", "") for e in ends)
    gone |= {
        r
        for r, p in by_rank.items()
        if p.get("addr") and f"[{p['addr']}]" in messages and p["node"] != this_node
    }
    nodes = sorted({by_rank[r]["node"] for r in gone if r in by_rank} - {this_node})
    if not nodes:
        nodes = sorted({int(p["node"]) for p in places} - {this_node})
    step = max((int(e.get("step", 0)) for e in ends), default=0)
    named = "; ".join(
        f"node {n} ({', '.join(sorted({p['host'] for p in places if p['node'] == n}))}: ranks "
        f"{', '.join(str(p['rank']) for p in places if p['node'] == n)})"
        for n in nodes
    )
    lost = f", lost during step {step}" if step else ""
    return f"{named} did not come back{lost}"
