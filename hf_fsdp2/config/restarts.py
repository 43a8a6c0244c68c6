"""The restart section of a recipe: restarts by torch's elastic agent, the hang watchdog, the preemption window
(docs/restarts.md). It validates itself."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hf_fsdp2.config.plans import check

# A watched step's bound when hang_timeout is unset: this many times the slowest step measured, never below the floor
# (a recompile mid-run, a profiler trace written at a step's end, a slow step of a long sequence stay under it).
HANG_FACTOR = 5.0
HANG_FLOOR_S = 300.0
# What torchrun's agent, Slurm (KillWait) and Kubernetes (terminationGracePeriodSeconds) give by default.
KILL_WINDOW_S = 30.0


@dataclass(kw_only=True)
class RestartArgs:
    """Runs that finish by themselves: restarts, hangs, preemption."""

    max_restarts: int | None = field(
        default=None,
        metadata={
            "help": "Restarts of the run by torch's elastic agent after a rank fails or hangs, each resuming from "
            "the run's newest checkpoint. hf-fsdp2 train passes it to the launcher; under accelerate launch or "
            "torchrun give the launcher the same --max_restarts (unset: the launcher's)."
        },
    )
    hang_timeout: float | None = field(
        default=None,
        metadata={
            "help": f"Seconds a training step may go without finishing before the run is named hung (every rank's "
            f"stack dumped) and ends for a restart; unset: {HANG_FACTOR:g}x the slowest step measured, at least "
            f"{HANG_FLOOR_S:g}; 0 = no watchdog. Checkpoint saves, evaluation and the export do not count."
        },
    )
    kill_window: float = field(
        default=KILL_WINDOW_S,
        metadata={
            "help": "Seconds between the SIGTERM and the SIGKILL of a preemption (torchrun, Slurm's KillWait, "
            "Kubernetes' terminationGracePeriodSeconds: 30 by default); the run says when a checkpoint cannot fit."
        },
    )

    def validate(self) -> None:
        """Raises ConfigError for a value argparse cannot refuse."""
        check(
            self.max_restarts is None or self.max_restarts >= 0,
            f"max_restarts={self.max_restarts} must be >= 0 (0 = no restart)",
        )
        check(
            self.hang_timeout is None or (self.hang_timeout >= 0 and math.isfinite(self.hang_timeout)),
            f"hang_timeout={self.hang_timeout} must be >= 0 seconds (0 = no watchdog; unset = from the step time)",
        )
        check(
            self.kill_window > 0 and math.isfinite(self.kill_window),
            f"kill_window={self.kill_window} must be > 0 seconds (the scheduler's time between SIGTERM and SIGKILL)",
        )
