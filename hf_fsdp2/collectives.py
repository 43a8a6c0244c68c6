"""The only place ranks talk outside FSDP2 itself: rank, world, barrier, agreement, broadcast, gather.

Every function here is collective unless it says otherwise: every rank of the default process group
calls it, in the same order. Each works without a process group (one process) as the identity, so
library code calls them unconditionally and stays on one code path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def initialized() -> bool:
    """True when a default process group exists (not collective)."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank in the default group; 0 without one (not collective)."""
    return dist.get_rank() if initialized() else 0


def world() -> int:
    """Processes in the default group; 1 without one (not collective)."""
    return dist.get_world_size() if initialized() else 1


def barrier() -> None:
    """Wait for every rank."""
    if initialized() and world() > 1:
        dist.barrier()


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
    same on every rank; taking it through this function makes it so by construction.
    """
    value = torch.tensor([0 if flag else 1], dtype=torch.int64, device=_device())
    return int(all_reduce_sum(value).item()) == 0


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
    """Rank ``src``'s ``value`` on every rank (a picklable object)."""
    if not (initialized() and world() > 1):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]  # type: ignore[no-any-return]


def gather_objects(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank."""
    if not (initialized() and world() > 1):
        return [value]
    out: list[Any] = [None] * world()
    dist.all_gather_object(out, value)
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
