"""Preemption inside the kill window: whether a SIGTERM can still end in a checkpoint before the SIGKILL.

A scheduler that preempts a job sends SIGTERM, then SIGKILL ``kill_window`` seconds later (30 s: torchrun's agent,
Slurm's KillWait, Kubernetes' terminationGracePeriodSeconds). The run answers SIGTERM at the next step boundary with a
checkpoint (:mod:`hf_fsdp2.checkpoint.preemption`), so the worst case is a whole step plus a save. The run says
whether that fits, with the figures: at start-up when the save alone cannot (its size at an estimated write rate),
once two steps are measured, and again when the first save is measured if the verdict changes; when it does not fit it
offers what does (a checkpoint cadence that bounds the work a SIGKILL loses, a longer grace). Not collective: rank 0
says it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# A rank's write rate until its first save is measured: a conservative figure for a shared or network file system
# (local NVMe writes several times faster).
ESTIMATED_WRITE_BYTES_S = 0.5e9
MARGIN_S = 2.0  # the exit after the save: the ranks' agreement, the process group's end
WORK_AT_RISK_S = 600.0  # the work a SIGKILL may lose with the cadence offered (save_steps)


def _s(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 100 else f"{seconds:.0f} s"


def verdict(
    *,
    step_s: float,
    save_s: float,
    window_s: float,
    measured_save: bool,
    save_steps: int,
    save_async: bool,
) -> tuple[bool, str]:
    """(fits, the words with the figures): a SIGTERM that lands just after a step boundary waits a whole step, then a
    save, then the exit, all within ``window_s``."""
    need = step_s + save_s + MARGIN_S
    how = "measured" if measured_save else f"estimated at {ESTIMATED_WRITE_BYTES_S / 1e9:g} GB/s per rank"
    figures = (
        f"a SIGTERM is answered at the next step boundary with a checkpoint: a step ({_s(step_s)}) + a save "
        f"({_s(save_s)}, {how}) + the exit ({_s(MARGIN_S)}) = {_s(need)}"
    )
    if need <= window_s:
        return True, f"preemption: {figures}, within the {_s(window_s)} kill window (kill_window)"
    cadence = max(1, math.floor(WORK_AT_RISK_S / max(step_s, 1e-3)))
    grace = math.ceil(need * 1.2)
    if 0 < save_steps <= cadence:
        cadence_offer = (
            f"the checkpoints every save_steps={save_steps} (~{_s(save_steps * step_s)}) already bound the work the "
            "SIGKILL loses"
        )
    else:
        cadence_offer = (
            f"save_steps: {cadence} (a checkpoint every ~{_s(cadence * step_s)}: no more work than that lost to the "
            "SIGKILL" + (", each save overlapping training with save_async: true)" if not save_async else ")")
        )
        cadence_offer += (
            f"; save_steps is {save_steps} now"
            if save_steps
            else "; no periodic checkpoint now (save_steps 0)"
        )
    offers = [
        cadence_offer,
        f"a grace of at least {grace} s from the scheduler (Slurm: #SBATCH --signal=TERM@{grace} or KillWait; "
        f"Kubernetes: terminationGracePeriodSeconds: {grace}), with kill_window: {grace}",
    ]
    what = (
        "a step alone is longer than the window: no step boundary comes before the SIGKILL"
        if step_s + MARGIN_S >= window_s
        else "the SIGKILL would land in the save (harmless: a half-written checkpoint is never published, and the "
        "previous one is resumed)"
    )
    return False, (
        f"preemption: {figures}, more than the {_s(window_s)} kill window (kill_window): {what}. What fits: "
        + "; or ".join(offers)
    )


@dataclass(kw_only=True)
class KillWindow:
    """The kill-window check of one run (rank 0 says it; every rank may hold one).

    Args:
        window_s: ``kill_window``.
        checkpoint_bytes: one checkpoint over all ranks (model and optimizer state).
        world: ranks that write it.
        save_steps: the run's checkpoint cadence.
        save_async: whether saves are written in the background (their measured time is then the staging only: the
            estimate stands for the write).
    """

    window_s: float
    checkpoint_bytes: int
    world: int
    save_steps: int
    save_async: bool
    save_s: float | None = None  # the slowest synchronous save measured
    _said: bool | None = None  # the verdict said so far (None: none yet)
    _with_measured_save: bool = False

    @property
    def estimated_save_s(self) -> float:
        return self.checkpoint_bytes / max(self.world, 1) / ESTIMATED_WRITE_BYTES_S

    def at_start(self) -> str | None:
        """At start-up: the words when the save alone cannot fit the window (its estimated time), else None."""
        save = self.estimated_save_s
        if save + MARGIN_S <= self.window_s:
            return None
        return verdict(
            step_s=0.0,
            save_s=save,
            window_s=self.window_s,
            measured_save=False,
            save_steps=self.save_steps,
            save_async=self.save_async,
        )[1].replace("a step (0.0 s) + ", "") + (
            f" (one checkpoint: {self.checkpoint_bytes / 1e9:.1f} GB over {self.world} rank(s))"
        )

    def saved(self, seconds: float) -> None:
        """A synchronous save took ``seconds`` on this rank."""
        if not self.save_async:
            self.save_s = max(self.save_s or 0.0, seconds)

    def check(self, durations: list[float]) -> tuple[bool, str] | None:
        """After a step (``durations``: every step's time so far, this one's included): the verdict and its words when
        they are due (two steps measured; then once more when the first measured save changes it), else None."""
        if len(durations) < 2:
            return None
        measured = self.save_s is not None
        if self._said is not None and (self._with_measured_save or not measured):
            return None
        step_s = max(durations[1:])  # the first one compiles and warms up
        fits, words = verdict(
            step_s=step_s,
            save_s=self.save_s if measured else self.estimated_save_s,  # type: ignore[arg-type]
            window_s=self.window_s,
            measured_save=measured,
            save_steps=self.save_steps,
            save_async=self.save_async,
        )
        first, self._with_measured_save = self._said is None, measured
        if not first and fits == self._said:
            return None
        self._said = fits
        return fits, words
