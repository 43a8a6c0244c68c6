"""Profiling and debugging switches: torch.profiler traces, CUDA memory snapshots, distributed debug env.

- ``profile_steps: "a-b"``: torch.profiler records steps a..b (one warm-up step before a when there is
  one) and each rank writes a Chrome trace ``<output_dir>/profile/rank<r>.<time>.pt.trace.json``
  (Perfetto, chrome://tracing, or TensorBoard's profiler plugin on ``<output_dir>/profile``).
- ``memory_snapshot_steps: "a-b"`` (CUDA only): the caching allocator records every allocation with
  its stack from step a to step b, then each rank dumps
  ``<output_dir>/profile/memory_snapshot_rank<r>_steps<a>-<b>.pickle`` (https://pytorch.org/memory_viz).
- ``distributed_debug: info|detail`` sets TORCH_DISTRIBUTED_DEBUG, NCCL_DEBUG, TORCH_CPP_LOG_LEVEL
  (and for detail the NCCL flight recorder) before the process group exists.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("hf_fsdp2")

PROFILE_DIR = "profile"


# Variables each distributed_debug level sets (unless the environment already sets them).
_DEBUG_ENV: dict[str, dict[str, str]] = {
    "off": {},
    "info": {"TORCH_DISTRIBUTED_DEBUG": "INFO", "NCCL_DEBUG": "INFO", "TORCH_CPP_LOG_LEVEL": "INFO"},
    "detail": {
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,COLL",
        "TORCH_CPP_LOG_LEVEL": "INFO",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    },
}
DEBUG_VARIABLES = (
    "TORCH_DISTRIBUTED_DEBUG",
    "NCCL_DEBUG",
    "NCCL_DEBUG_SUBSYS",
    "TORCH_CPP_LOG_LEVEL",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_FR_BUFFER_SIZE",
    "TORCH_NCCL_DUMP_ON_TIMEOUT",
)


def apply_distributed_debug(level: str, debug_dir: str | Path) -> list[str]:
    """Set the debug variables of ``level`` in this process (call before the process group exists).

    A variable the environment already sets keeps its value. With ``detail`` the NCCL flight recorder
    dumps each rank's last collectives to ``<debug_dir>/nccl_trace_rank_<r>`` on a timeout; the caller
    creates ``debug_dir`` (on every node) once the output folder has been checked.

    Args:
        level: ``off``, ``info`` or ``detail``.
        debug_dir: folder of the flight-recorder dumps.

    Returns:
        ``NAME=value`` of every debug variable in effect (set here or before), for the start-up log.

    Raises:
        ValueError: an unknown level.
    """
    if level not in _DEBUG_ENV:
        raise ValueError(f"distributed_debug={level!r} is not one of {sorted(_DEBUG_ENV)}")
    wanted = dict(_DEBUG_ENV[level])
    if level == "detail":
        wanted["TORCH_FR_DUMP_TEMP_FILE"] = str(Path(debug_dir) / "nccl_trace_rank_")
    for name, value in wanted.items():
        os.environ.setdefault(name, value)
    if wanted:
        import torch.distributed as dist

        # torch reads TORCH_DISTRIBUTED_DEBUG when it is imported; read it again.
        dist.set_debug_level_from_env()
    names = [*DEBUG_VARIABLES, *(n for n in wanted if n not in DEBUG_VARIABLES)]
    return [f"{n}={os.environ[n]}" for n in names if n in os.environ]


class StepProfiler:
    """torch.profiler over a range of steps and a CUDA memory snapshot over another; both optional.

    The recipe calls :meth:`start_step` before each optimizer step, :meth:`end_step` after it and
    :meth:`close` after the loop; outside the ranges these cost nothing.
    """

    def __init__(
        self,
        *,
        profile_steps: tuple[int, int] | None,
        memory_steps: tuple[int, int] | None,
        output_dir: str | Path,
        rank: int,
        device: torch.device,
        first_step: int,
        last_step: int,
    ) -> None:
        """Args:
        profile_steps: ``(a, b)`` steps traced by torch.profiler, or None.
        memory_steps: ``(a, b)`` steps of the CUDA memory snapshot, or None.
        output_dir: the run folder (traces go to ``output_dir/profile``).
        rank: this rank (file names).
        device: this rank's device.
        first_step: first step this process runs (a resumed run starts later).
        last_step: last step of the run.

        Raises:
            ValueError: a memory snapshot without CUDA.
        """
        if memory_steps is not None and device.type != "cuda":
            raise ValueError(
                f"memory_snapshot_steps={memory_steps[0]}-{memory_steps[1]} needs a CUDA device "
                f"(torch.cuda.memory), this run is on {device.type}; unset it, or use profile_steps, whose "
                "trace has a memory view on any device"
            )
        self.dir = Path(output_dir) / PROFILE_DIR
        self.rank, self.device = rank, device
        self.profile_steps = self._clip(profile_steps, "profile_steps", first_step, last_step)
        self.memory_steps = self._clip(memory_steps, "memory_snapshot_steps", first_step, last_step)
        self._prof: Any = None
        self._recording = False
        self.files: list[Path] = []

    @staticmethod
    def _clip(
        steps: tuple[int, int] | None, key: str, first_step: int, last_step: int
    ) -> tuple[int, int] | None:
        if steps is None:
            return None
        a, b = max(steps[0], first_step), min(steps[1], last_step)
        if a > b:
            logger.warning(
                "%s=%d-%d is outside the steps this run makes (%d..%d): nothing is recorded",
                key,
                steps[0],
                steps[1],
                first_step,
                last_step,
            )
            return None
        if (a, b) != steps:
            logger.info("%s=%d-%d: recording steps %d..%d of this run", key, steps[0], steps[1], a, b)
        return a, b

    def start_step(self, step: int) -> None:
        """Before optimizer step ``step``."""
        if self.profile_steps is not None and self._prof is None:
            a, b = self.profile_steps
            # One warm-up step before the range when it exists: the profiler's own start-up is not traced.
            warmup = 1 if step == a - 1 else 0
            if step == a - warmup:
                self._start_profiler(a, b, warmup)
        if self.memory_steps is not None and step == self.memory_steps[0]:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
            self._recording = True

    def _start_profiler(self, a: int, b: int, warmup: int) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        self.dir.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)

        def on_trace_ready(prof: Any) -> None:
            tensorboard_trace_handler(str(self.dir), worker_name=f"rank{self.rank}")(prof)
            self.files = sorted(self.dir.glob(f"rank{self.rank}.*.pt.trace.json"))
            logger.info("profiler: steps %d-%d traced to %s", a, b, self.dir)

        first = a - warmup
        self._prof = profile(
            activities=activities,
            schedule=schedule(skip_first=first, wait=0, warmup=warmup, active=b - a + 1, repeat=1),
            on_trace_ready=on_trace_ready,
            record_shapes=True,
            profile_memory=True,
        )
        # The profiler counts steps from 0; from the run's step number instead, its "ProfilerStep#<n>"
        # ranges in the trace carry the step numbers of metrics.jsonl (skip_first keeps the schedule aligned).
        self._prof.step_num = first
        self._prof.start()

    def end_step(self, step: int) -> None:
        """After optimizer step ``step``."""
        if self._prof is not None:
            self._prof.step()
            if self.profile_steps is not None and step >= self.profile_steps[1]:
                self._prof.stop()
                self._prof, self.profile_steps = None, None
        if self._recording and self.memory_steps is not None and step >= self.memory_steps[1]:
            self._dump_memory(*self.memory_steps)

    def _dump_memory(self, a: int, b: int) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"memory_snapshot_rank{self.rank}_steps{a}-{b}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
        self._recording, self.memory_steps = False, None
        self.files.append(path)
        logger.info(
            "memory snapshot of steps %d-%d: %s (open it on https://pytorch.org/memory_viz)", a, b, path
        )

    def close(self) -> None:
        """Stop whatever still records (a run stopped inside a range) and write what it has."""
        if self._prof is not None:
            self._prof.stop()
            self._prof = None
        if self._recording and self.memory_steps is not None:
            self._dump_memory(*self.memory_steps)
