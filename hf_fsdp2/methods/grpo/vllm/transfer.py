"""The weights' way from the trainer to the vLLM server (``vllm_mode: server``): a process group of the trainer's
rank 0 and the engine's workers, opened once when the run connects, over which each update's units go as one
broadcast each, in the engine's dtype, device to device.

- The group: rank 0 of the trainer is its rank 0 and hosts its store (``vllm_group_port``; 0: a free port); each of
  the engine's ``W`` workers joins as rank ``1 + its rank`` (:func:`~.server.join_weight_group`, run in every worker
  through vLLM's ``collective_rpc``). NCCL when the server's engine runs on GPUs, gloo on CPU (a TCP store and the
  backend created explicitly on both sides: never the default group, which the trainer's ranks own). The trainer
  and the server are different Pythons (the server's environment pins vLLM's torch): both ends must speak the same
  wire protocol, so an NCCL group refuses two NCCL versions (:func:`check_backend`).
- An update (:func:`push_weights`, every rank): one HTTP request (``POST /weights/update``, the units' names,
  shapes and dtype) on a thread of rank 0, answered once the workers loaded it; meanwhile every rank gathers each
  unit in the engine's dtype (:func:`~hf_fsdp2.parallel.gather.gathered_units`) and rank 0 broadcasts it to the
  workers, which load it in place and free it before the next. Nothing goes through host memory or HTTP.
- Failures: the rendezvous waits ``vllm_server_timeout`` at most, each broadcast ``vllm_request_timeout``; a server that dies closes its end (gloo fails at
  once); a failed update stops rank 0's broadcasts (its group closed, so the workers stop waiting), rank 0 still
  takes part in every gather, and every rank raises the same :class:`~.client.VllmServerError`.

Counts per update (:class:`SyncCounts`), units ``U`` holding ``N`` elements in a ``b``-byte dtype: the gathers'
(:class:`~hf_fsdp2.parallel.gather.GatherCounts`); ``broadcasts`` = ``U`` on rank 0 of ``N b`` bytes in all; one
HTTP request; ``host_bytes`` = 0 (the gathers' own, for CPU-offloaded shards under NCCL, aside).
"""

from __future__ import annotations

import datetime
import logging
import socket
import time
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import torch

from hf_fsdp2 import collectives
from hf_fsdp2.parallel.gather import GatherCounts, gathered_units, sync_units

logger = logging.getLogger("hf_fsdp2")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class VllmServerError(ValueError):
    """The vLLM server is not up, failed a request, or runs other weights than the trainer's: a ValueError, as
    :class:`~.rewards.RewardError`, so the recipe says it in one line (exit status 2) after every rank raised it."""


@dataclass(kw_only=True)
class SyncCounts:
    """What one weight update moved, on this rank (the module docstring's formula)."""

    gather: GatherCounts = field(default_factory=GatherCounts)
    broadcasts: int = 0  # rank 0 -> the engine's workers
    broadcast_bytes: int = 0
    requests: int = 0  # HTTP requests of the update (the probe's aside)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        g = self.gather
        return {
            "units": g.units,
            "tensors": g.tensors,
            "all_gathers": g.collectives,
            "gathered_bytes": g.bytes,
            "host_bytes": g.host_bytes,
            "broadcasts": self.broadcasts,
            "broadcast_bytes": self.broadcast_bytes,
            "requests": self.requests,
            "seconds": self.seconds,
        }


COUNTED = ("engine_calls", "engine_prompts", "all_gathers", "gathered_bytes", "broadcast_bytes", "host_bytes")


def add_sync_counts(counted: dict[str, float], counts: SyncCounts) -> None:
    """A weight update's counts into a generator's running totals."""
    counted["all_gathers"] += counts.gather.collectives
    counted["gathered_bytes"] += counts.gather.bytes
    counted["broadcast_bytes"] += counts.broadcast_bytes
    counted["host_bytes"] += counts.gather.host_bytes


def local_address(url: str) -> str:
    """This host's address as the server at ``url`` reaches it: the source address of the route to it (no packet is
    sent), the loopback for a server on this host."""
    host = urlparse(url).hostname or "127.0.0.1"
    if host in ("localhost", "0.0.0.0", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return str(probe.getsockname()[0])


def check_backend(info: dict[str, Any], trainer_device: torch.device, url: str) -> str:
    """The group's backend from the server's /health (``weight_backend``: nccl on GPUs, gloo on CPU), checked
    against this trainer.

    Raises:
        ValueError: a GPU server with a CPU trainer or the reverse, or NCCL versions that differ.
    """
    backend = str(info.get("weight_backend", "gloo"))
    if (backend == "nccl") != (trainer_device.type == "cuda"):
        raise ValueError(
            f"the vLLM server at {url} runs its engine on {'GPU' if backend == 'nccl' else 'CPU'} and this trainer on "
            f"{trainer_device.type}: the weights go device to device ({backend}), so both run on GPUs or both on "
            "CPU; start the server where the trainer's device kind is"
        )
    if backend == "nccl":
        mine = ".".join(map(str, torch.cuda.nccl.version()))  # type: ignore[no-untyped-call]
        theirs = str(info.get("nccl"))
        if mine.split(".")[:2] != theirs.split(".")[:2]:
            raise ValueError(
                f"NCCL {mine} in this trainer (torch {torch.__version__}) and {theirs} in the vLLM server at {url} "
                f"(torch {info.get('torch')}): one NCCL group needs one NCCL version on both ends; install the "
                "same nvidia-nccl in both environments"
            )
    return backend


class WeightGroup:
    """Rank 0's end of the trainer-server group (the module docstring): :meth:`broadcast` sends one unit."""

    def __init__(self, group: Any, store: Any, backend: str, *, workers: int, timeout_s: float) -> None:
        self.group, self.store, self.backend = group, store, backend
        self.workers, self.timeout_s = workers, timeout_s

    @classmethod
    def open(
        cls,
        client: Any,
        info: dict[str, Any],
        device: torch.device,
        port: int,
        *,
        timeout_s: float,
        connect_s: float,
    ) -> WeightGroup:
        """Host the store, ask the server's workers to join (a request on a thread: they block in the rendezvous
        until this end joins too) and join as rank 0 (rank 0 of the trainer only). ``connect_s``: how long the
        rendezvous may take (``vllm_server_timeout``); ``timeout_s``: each broadcast (``vllm_request_timeout``)."""
        import torch.distributed as dist

        backend = check_backend(info, device, client.url)
        workers = int(info.get("workers", 1))
        host = local_address(client.url)
        connect = datetime.timedelta(seconds=connect_s)
        store = dist.TCPStore(
            host, port, 1 + workers, is_master=True, timeout=connect, wait_for_workers=False
        )
        # Both ends block in the rendezvous until every rank joined (up to connect_s): this end on one thread, the
        # server's request on another; a server that answers first with an error (its workers cannot reach the
        # store) stops the wait at once, its reason raised.
        joined = in_thread(client.open_group, host, int(store.port), backend, timeout_s, connect_s)
        built = in_thread(
            _backend_group, dist.PrefixStore("hf_fsdp2_weights", store), 1 + workers, backend, connect
        )
        wait([joined, built], return_when=FIRST_EXCEPTION)
        joined.result()
        group = built.result()
        return cls(group, store, backend, workers=workers, timeout_s=timeout_s)

    def broadcast(self, flat: torch.Tensor) -> None:
        """``flat`` (one unit, the engine's dtype) to every worker of the engine; returns once it is sent."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        opts.timeout = datetime.timedelta(seconds=self.timeout_s)  # the group's own: the rendezvous's
        self.group.broadcast([flat], opts).wait()
        if flat.is_cuda:  # the unit's buffer is freed next: its send must be done (one host sync per unit)
            torch.cuda.current_stream(flat.device).synchronize()

    def close(self) -> None:
        """Drop this end: the workers' pending receives fail at once instead of waiting out the timeout."""
        self.group = None
        self.store = None


def in_thread(fn: Any, *args: Any) -> Future[Any]:
    """``fn(*args)`` on a daemon thread: a wait left behind after a failure (a rendezvous, a request) never holds
    the process at exit, as an executor's threads would."""
    import threading

    future: Future[Any] = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as err:  # noqa: BLE001 - the caller's result() raises it
            future.set_exception(err)

    threading.Thread(target=run, daemon=True).start()
    return future


def _backend_group(store: Any, size: int, backend: str, timeout: datetime.timedelta) -> Any:
    """Rank 0 of a ``size``-rank group over ``store`` (the workers join as 1..size-1)."""
    import torch.distributed as dist

    if backend == "nccl":
        nccl = dist.ProcessGroupNCCL  # type: ignore[attr-defined]
        options = nccl.Options()
        options._timeout = timeout
        return nccl(store, 0, size, options)
    return dist.ProcessGroupGloo(store, 0, size, timeout)


def bucket_plan(units: list[Any], dtype_name: str) -> list[dict[str, Any]]:
    """What the server's workers are told to receive: each unit's tensors (checkpoint names, shapes) in order."""
    return [{"dtype": dtype_name, "tensors": [[n, list(p.shape)] for n, p in unit]} for unit in units]


def push_weights(
    model: torch.nn.Module, client: Any, group: WeightGroup | None, version: int, dtype_name: str
) -> SyncCounts:
    """Send every parameter to the server, a unit at a time in ``dtype_name``, as weights ``version`` (every rank
    calls it: each unit's gather is a collective; rank 0 broadcasts and asks). Returns this rank's counts.

    Raises:
        VllmServerError: on every rank, when rank 0's request or broadcasts failed (the others keep gathering until
            the end, so every rank runs the same collectives, then all raise).
    """
    start = time.perf_counter()
    counts = SyncCounts()
    units = sync_units(model)
    sender = collectives.rank() == 0
    error: str | None = None
    answer = None
    future: Future[dict[str, Any]] | None = None
    if sender:
        if group is None or group.group is None:
            error = "no weight group with the server (it closed after an earlier failure)"
        else:
            future = in_thread(client.update_weights, version, bucket_plan(units, dtype_name))
            counts.requests += 1
    for unit in gathered_units(units, DTYPES[dtype_name], sender, counts.gather):
        if future is None or error is not None or unit.flat is None or group is None:
            continue
        if future.done():  # the server answered before every unit was sent: its error says why
            error = _outcome(future) or "the server answered the update before receiving every unit"
            group.close()
            continue
        try:
            group.broadcast(unit.flat)
            counts.broadcasts += 1
            counts.broadcast_bytes += unit.flat.numel() * unit.flat.element_size()
        except Exception as err:  # noqa: BLE001 - said on every rank below
            error = f"sending a unit over the weight group: {type(err).__name__}: {err}"
            group.close()
    if future is not None:  # the server's own answer: its reason first when both ends failed
        failed = _outcome(future)
        if failed is not None:
            error = failed if error is None or failed in error else f"{failed} ({error})"
        answer = None if failed else future.result()
    if answer is not None and error is None:
        want = sum(len(u) for u in units)
        if answer.get("weights_version") != version or int(answer.get("loaded", -1)) != want:
            error = f"the server loaded {answer.get('loaded')} of {want} tensors as version {answer.get('weights_version')}"

    def outcome() -> None:
        if error is not None:
            raise VllmServerError(
                f"the vLLM server at {client.url} did not take weights version {version}: {error}"
            )

    collectives.run_on_all("sending the weights to the vLLM server", outcome, VllmServerError)
    counts.seconds = time.perf_counter() - start
    return counts


def _outcome(future: Future[dict[str, Any]]) -> str | None:
    """The update request's error (None: it answered), waiting for it."""
    try:
        future.result()
    except Exception as err:  # noqa: BLE001 - VllmServerError, or the thread's own failure
        return str(err)
    return None
