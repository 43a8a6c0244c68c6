"""The only place ranks talk outside FSDP2 itself: rank, world, barrier, agreement, broadcast, gather.

Every function here is collective unless it says otherwise: every rank of the default process group
calls it, in the same order. Each works without a process group (one process) as the identity, so
library code calls them unconditionally and stays on one code path.

Two groups carry the traffic. Device tensors (sums, maxima, gathers of numbers) go over the default group,
NCCL on a GPU. Host values (a flag every rank must agree on, pickled objects, the waits behind rank 0's
long work) go over the *host group*: a gloo group over the same ranks that :func:`init_host_group` creates
once, right after the default group (``build_accelerator`` does). Over it a flag never becomes a device
tensor, so agreeing on it does not wait for the GPU's queued work, and its timeout (``host_wait_timeout``,
hours) is its own: a rank waiting while rank 0 tokenises a large dataset or reloads a 30B export in a
subprocess is not killed by the NCCL watchdog after ``ddp_timeout``. A rank that really hangs is still
caught: the others then wait in a device collective, whose watchdog (``ddp_timeout``) ends the job.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

# How long the host group waits by default (``host_wait_timeout``): a rank-0-only step of a large run (the
# export's reload of a 30B+ model in a subprocess, tokenising a large dataset) takes tens of minutes to hours.
HOST_WAIT_TIMEOUT_S = 6 * 3600

# The host group, its timeout, and the default group it was made beside (a group of a destroyed default
# group is never used again); ``peers``: every rank's (machine, pid), to name a rank that died (peer_lost).
_HOST: dict[str, Any] = {"group": None, "timeout_s": None, "default": None, "peers": None}


def initialized() -> bool:
    """True when a default process group exists (not collective)."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank in the default group; 0 without one (not collective)."""
    return dist.get_rank() if initialized() else 0


def world() -> int:
    """Processes in the default group; 1 without one (not collective)."""
    return dist.get_world_size() if initialized() else 1


# The run's model-parallel layout (:func:`set_layout`): ranks that share one data rank (``cp x tp``, innermost in
# the mesh dp_replicate x dp_shard x cp x tp, Accelerate's order), the context-parallel group, and the TP size.
_LAYOUT: dict[str, Any] = {"cp": 1, "tp": 1, "cp_group": None}


def set_layout(*, cp: int = 1, tp: int = 1, cp_group: Any = None) -> None:
    """Record the run's context- and tensor-parallel sizes (not collective; every rank sets the same values once the
    mesh exists). Ranks ``k * cp * tp`` .. ``(k + 1) * cp * tp - 1`` read the same batches (data rank ``k``); FSDP2
    averages gradients over ``world / tp`` ranks (a TP group holds one copy of each gradient shard)."""
    if cp < 1 or tp < 1 or world() % (cp * tp):
        raise ValueError(f"cp={cp} x tp={tp} does not divide the world size {world()}")
    _LAYOUT.update(cp=cp, tp=tp, cp_group=cp_group)


def cp_size() -> int:
    """Ranks one sequence is split over (context parallel); 1 without (not collective)."""
    return int(_LAYOUT["cp"])


def cp_group() -> Any:
    """The context-parallel process group of this rank (None without context parallel; not collective)."""
    return _LAYOUT["cp_group"]


def cp_rank() -> int:
    """This rank's position in its context-parallel group: which part of each sequence it holds (not collective)."""
    return (rank() // tp_size()) % cp_size()


def tp_size() -> int:
    """Ranks one layer's weights are split over (tensor parallel); 1 without (not collective)."""
    return int(_LAYOUT["tp"])


def data_world() -> int:
    """Ranks that read different batches: ``world / (cp x tp)`` (not collective)."""
    return world() // (cp_size() * tp_size())


def data_rank() -> int:
    """Which batches this rank reads: its index among the data-parallel ranks (not collective)."""
    return rank() // (cp_size() * tp_size())


def grad_world() -> int:
    """Ranks FSDP2 averages each gradient over: ``world / tp`` (a micro-batch's summed loss is scaled by it over the
    step's count, so the accumulated gradient is the step's mean; not collective)."""
    return world() // tp_size()


def init_host_group(timeout_s: int = HOST_WAIT_TIMEOUT_S) -> None:
    """Create the host (gloo) group over every rank of the default group, with its own timeout.

    Collective: every rank calls it once, at the same point, right after the default group exists (a
    group's creation is itself a collective of the default group). A second call is a no-op, and so is a
    call without a process group or with one rank (there is nothing to wait for).

    Args:
        timeout_s: seconds a wait over the host group may last (``host_wait_timeout``).

    Raises:
        ValueError: ``timeout_s`` is not positive.
    """
    if timeout_s <= 0:
        raise ValueError(f"host_wait_timeout={timeout_s} must be > 0 seconds")
    if _host() is not None or not initialized() or world() == 1:
        return
    from datetime import timedelta

    # Even where the default group is gloo (CPU) or can take CPU tensors (``cpu:gloo,cuda:nccl`` under CPU
    # offload), its timeout is ``ddp_timeout``: the host group is a group of its own for its own timeout.
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    _HOST.update(group=group, timeout_s=timeout_s, default=dist.group.WORLD)
    # Each rank's process, once: a rank killed later (kill -9, the OOM killer) prints nothing, and a collective
    # only says that "a peer" closed its connection; the ranks on this machine can then see which process is gone.
    _HOST["peers"] = gather_objects((_machine(), os.getpid()))


def host_group_timeout() -> int | None:
    """The host group's timeout in seconds; None when there is no host group (not collective)."""
    return _HOST["timeout_s"] if _host() is not None else None


def _host() -> Any:
    """The group host values go over: the host group, else (no :func:`init_host_group` call: a process group
    made by hand, as some tests do) None: the default group."""
    if _HOST["group"] is not None and (not initialized() or _HOST["default"] is not dist.group.WORLD):
        _HOST.update(group=None, timeout_s=None, default=None, peers=None)  # its default group was destroyed
    return _HOST["group"]


def _host_device() -> torch.device:
    """The device host-value collectives put their tensors on: the host, unless they fall back to an NCCL
    default group."""
    return torch.device("cpu") if _host() is not None else _device()


def barrier() -> None:
    """Wait for every rank (over the default group; on NCCL on the current device, named so NCCL does not
    guess it from the rank)."""
    if initialized() and world() > 1:
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()


def host_barrier() -> None:
    """Wait for every rank over the host group (``host_wait_timeout``): for a wait behind long host work."""
    if initialized() and world() > 1:
        group = _host()
        if group is None:
            barrier()
        else:
            dist.barrier(group=group)


def gather_before_exit(timeout_s: float = 30.0) -> bool:
    """Every rank waits here for the others, at most ``timeout_s``, before a failed run's processes exit.

    Rank 0 reports an error that every rank raised; a rank that exited first would make the launcher kill rank 0
    before it printed the report. Over the host (gloo) group, whose ``monitored_barrier`` takes a timeout: a rank
    that never comes (it failed alone) costs ``timeout_s``, never a hang. Not collective in the strict sense:
    every rank calls it, but a missing one only delays the others. Returns whether the ranks met (False without
    a process group, e.g. a refusal before one exists).
    """
    if not (initialized() and world() > 1):
        return False
    # Before the host group exists (a refusal at start-up), the default group where it is gloo (CPU runs).
    group = _host() or (dist.group.WORLD if dist.get_backend() == "gloo" else None)
    if group is None:
        return False
    import contextlib
    from datetime import timedelta

    # A rank missing or gone: leave anyway, the launcher reports the exit statuses.
    with contextlib.suppress(Exception):
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
        return True
    return False


def _device() -> torch.device:
    """The device collectives of the default backend take tensors on (NCCL: the current GPU)."""
    if initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over all ranks, in place (it must be on the backend's device); returns it."""
    if initialized() and world() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def all_ranks_true(flag: bool) -> bool:
    """True on every rank iff ``flag`` is true on every rank: one side of a branch for all of them.

    A choice that decides which collectives run next (the loss path, whether to evaluate) must be the
    same on every rank; taking it through this function makes it so by construction. The flag goes over
    the host group as a host tensor: the answer never waits for the device's queued work. One process:
    ``flag`` itself, no tensor at all.
    """
    if not (initialized() and world() > 1):
        return flag
    value = torch.tensor([0 if flag else 1], dtype=torch.int64, device=_host_device())
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=_host())
    return int(value.item()) == 0


def all_reduce_max(values: Sequence[float]) -> list[float]:
    """Element-wise maximum of a few numbers over ranks."""
    tensor = torch.tensor(list(values), dtype=torch.float64, device=_device())
    if initialized() and world() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [float(v) for v in tensor.cpu()]


def gather_rows(values: Sequence[float], device: torch.device | None = None) -> torch.Tensor:
    """Every rank's ``values`` as the rows of a ``[world, len(values)]`` float64 tensor on the host."""
    local = torch.tensor(list(values), dtype=torch.float64, device=device or _device())
    if not (initialized() and world() > 1):
        return local[None].cpu()
    rows = [torch.empty_like(local) for _ in range(world())]
    dist.all_gather(rows, local)
    return torch.stack(rows).cpu()


def broadcast_object(value: T, src: int = 0) -> T:
    """Rank ``src``'s ``value`` on every rank (a picklable object), over the host group: the other ranks may
    wait here for rank ``src``'s long work (up to ``host_wait_timeout``)."""
    if not (initialized() and world() > 1):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src, group=_host())
    return box[0]  # type: ignore[no-any-return]


def gather_objects(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank (over the host group, like broadcast_object)."""
    if not (initialized() and world() > 1):
        return [value]
    out: list[Any] = [None] * world()
    dist.all_gather_object(out, value, group=_host())
    return out


def first_failure(error: str | None) -> tuple[int, str] | None:
    """The lowest rank whose ``error`` is not None and its message, on every rank; None if none failed."""
    for r, message in enumerate(gather_objects(error)):
        if message is not None:
            return r, message
    return None


def run_on_all(phase: str, fn: Callable[[], T], error_type: type[Exception]) -> T:
    """Run ``fn`` on every rank; if it raises on any rank, raise ``error_type`` on every rank.

    One rank's failure then never leaves the others waiting in the next collective, and every rank
    reports the same first failure (rank and message).

    Args:
        phase: what is being done, for the message ("writing part 2").
        fn: the work of this rank.
        error_type: the exception raised on every rank when some rank failed.

    Returns:
        ``fn()``'s result on this rank.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    result: Any = None
    error: str | None = None
    try:
        result = fn()
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        error = f"{type(err).__name__}: {err}"
    failed = first_failure(error)
    if failed is not None:
        raise error_type(f"failed while {phase} (rank {failed[0]}): {failed[1]}")
    return result  # type: ignore[no-any-return]


def _portable(error: BaseException) -> BaseException:
    """``error`` if it survives pickling (to send it to other ranks), else a RuntimeError with its text."""
    import pickle

    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def rank0_first(fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0, then on the other ranks (rank 0 fills a cache the others then read).

    A failure on rank 0 is raised on every rank as the same exception (the others never start ``fn``);
    a failure on another rank is raised on every rank too. One error per failure, never a rank left
    waiting in a collective that a failed rank skipped.

    Returns:
        ``fn()``'s result on this rank.
    """
    result: Any = None
    error: BaseException | None = None
    if rank() == 0:
        try:
            result = fn()
        except Exception as err:
            error = err
    first = broadcast_object(None if error is None else _portable(error))
    if first is not None:
        raise error if error is not None else first
    later: BaseException | None = None
    if rank() != 0:
        try:
            result = fn()
        except Exception as err:
            later = err
    failures = [e for e in gather_objects(None if later is None else _portable(later)) if e is not None]
    if failures:
        raise later if later is not None else failures[0]
    return result  # type: ignore[no-any-return]


def rank0_decides(fn: Callable[[], None]) -> None:
    """Run ``fn`` on rank 0 only; if it raises, raise the same exception on every rank."""
    error: BaseException | None = None
    if rank() == 0:
        try:
            fn()
        except Exception as err:
            error = err
    sent = broadcast_object(None if error is None else _portable(error))
    if sent is not None:
        raise error if error is not None else sent


# What gloo (and NCCL) say when the process at the other end of a connection is gone: the message names the
# peer's address, never its rank.
_PEER_LOST = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "remote process exited",
)


def _machine() -> str:
    """This process's machine and pid namespace (two containers on one host do not see each other's pids)."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return f"{socket.gethostname()}:{namespace}"


def _gone(pid: int) -> bool:
    """Whether process ``pid`` of this machine has ended (no /proc entry, or a zombie its parent has not reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[:1] in (["Z"], ["X"])


def gone_ranks(wait_s: float = 2.0) -> list[int]:
    """The ranks on this machine whose process has ended (not collective: a look at /proc), after up to ``wait_s``
    for one to appear (a killed process closes its sockets a moment before it ends). Ranks on other machines are
    never named; empty without the pids that :func:`init_host_group` gathered."""
    peers = _HOST["peers"] or []
    here = _machine()
    mine = [(r, pid) for r, (machine, pid) in enumerate(peers) if machine == here and pid != os.getpid()]
    deadline = time.monotonic() + wait_s
    while mine:
        gone = [r for r, pid in mine if _gone(pid)]
        if gone or time.monotonic() >= deadline:
            return gone
        time.sleep(0.1)
    return []


_PACKAGE = Path(os.path.realpath(__file__)).parent


def _in_package(filename: str) -> bool:
    return Path(os.path.realpath(filename)).is_relative_to(_PACKAGE)


def _where(error: BaseException) -> str:
    """``"all_gather_object in rollout (hf_fsdp2/methods/grpo/step.py:106)"``: the torch.distributed call that
    failed and the library's code that made it (from the traceback; "" when neither is in it)."""
    frames = traceback.extract_tb(error.__traceback__)
    call = caller = ""
    for i, frame in enumerate(frames):
        name = frame.filename.replace(os.sep, "/")
        if name.endswith("torch/distributed/distributed_c10d.py") and not frame.name.startswith("_"):
            call = frame.name
            # The package's own frames by its folder, not by a "/hf_fsdp2/" in the path: dependencies installed under
            # a folder of that name (scripts/setup.sh's ~/.cache/hf_fsdp2/venv-base-*) are not the library.
            ours = [f for f in frames[:i] if _in_package(f.filename)]
            ours = [f for f in ours if os.path.realpath(f.filename) != os.path.realpath(__file__)] or ours
            if ours:
                f = ours[-1]
                caller = f"{f.name} ({Path(os.path.realpath(f.filename)).relative_to(_PACKAGE.parent).as_posix()}:{f.lineno})"
            break
    return " in ".join(part for part in (call, caller) if part)


def peer_lost(error: BaseException) -> tuple[str, list[int]] | None:
    """When ``error`` (or an error it was raised from) is a collective's lost connection to another rank: where it
    happened and the ranks of this machine whose process is gone (see :func:`gone_ranks`); else None.

    A rank killed by a signal (kill -9, the out-of-memory killer) or crashed in native code prints nothing; the
    others fail in their next collective with the transport's words ("Connection reset by peer [10.0.0.2]:41234"),
    which name an address, not the rank. Not collective.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current).lower()
        if isinstance(current, RuntimeError) and any(words in text for words in _PEER_LOST):
            return _where(current) or _where(error), gone_ranks()
        current = current.__cause__ or current.__context__
    return None


def peer_lost_message(where: str, gone: Sequence[int], me: int) -> str:
    """The one line for :func:`peer_lost`'s answer, said by rank ``me``."""
    during = f" during {where}" if where else ""
    cause = (
        "killed by a signal, e.g. kill -9 or the out-of-memory killer, or exited on an error of its own, printed "
        "above"
    )
    if gone:
        who = f"rank {gone[0]}" if len(gone) == 1 else "ranks " + ", ".join(str(r) for r in gone)
        return (
            f"{who} stopped (its process ended: {cause}) and rank {me} lost its connection to it{during}. The "
            f"launcher's status line says how {who} ended; for a signal, look for the cause in the system log "
            "(dmesg: 'Out of memory'), then continue with --resume_from_checkpoint latest"
        )
    return (
        f"a peer rank's connection closed{during} (rank {me}): another rank stopped ({cause}), on another machine "
        "or not yet ended. The launcher's status line names it and how it ended; for a signal, look for the cause "
        "in the system log (dmesg: 'Out of memory'), then continue with --resume_from_checkpoint latest"
    )
