"""Non-finite steps and collapse: found at every step without an extra wait for the device.

After each step's backward and clip, the step's flags are computed on the device, on every rank:
``[loss not finite (this rank), gradient norm not finite, gradient norm exactly 0]`` (the norm is global, the
same on every rank). Nothing is read then. The flags ride along with the next step's one all-reduce and host
read of its token counts (:func:`hf_fsdp2.train.step.forward_backward`), which sums them over the ranks: every
rank reads the same numbers at the same point, before the next step's forward is queued, and takes the same
branch. Steps that already read the device (a save, the last step, a SIGTERM stop) read the flags first
(:meth:`NonFiniteGuard.settle_now`), so a checkpoint is never written of a state after a non-finite step.

Why not read the flags at once: that read would wait for the whole backward at every step (a step reads the
device exactly once, in the counts' all-reduce). The price is that ``stop`` notices step N at the start of step N+1 -- before
any of its work -- or at step N's save.

The update of a non-finite step is never applied where the optimizer allows deciding it on the device: the
fused AdamW (CUDA and CPU, this project's default) takes ``found_inf`` (as under torch.amp.GradScaler) and
leaves weights, moments and step count unchanged when it is 1. With another optimizer, ``skip_step`` reads the
norm before the update (one more host read per step, documented), and ``stop`` lets the update happen: the
poisoned state is then never saved, the run stops before another step runs.

The learning-rate schedule advances on a skipped step (as in torch.amp GradScaler loops and the step-indexed
schedules of torchtitan): the schedule stays a function of the step number and of the data position, so a
resume reproduces it.

A run that learns nothing is decided like a diverged one (``on_collapse``): a collapse (the global gradient norm
exactly 0 for ``COLLAPSE_STEPS`` steps in a row that have target tokens) or a method's step without a learning
signal for as many steps (GRPO: no completion with a usable reward advantage, :meth:`NonFiniteGuard.no_signal`)
stops the run (``stop``: :class:`CollapseError`, exit status 2, the last good checkpoint named) or is warned about
once (``warn``). Either way it is a :class:`Finding`, handed to the run (``report``) for metrics.jsonl, summary.json
and the model card. Both are decided from values already summed over the ranks, so every rank takes the same
branch at the same point.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from hf_fsdp2 import collectives

logger = logging.getLogger("hf_fsdp2")

ON_NONFINITE = ("stop", "skip_step")
ON_COLLAPSE = ("stop", "warn")
# Consecutive steps with a gradient norm of exactly 0 while there are target tokens before the collapse is
# decided: a real gradient over millions of weights is never exactly 0; a collapsed model (a constant output,
# loss = ln(vocab)) or an all-frozen one gives exactly 0 at every step. A method's steps without a learning
# signal (GRPO: no usable reward) are counted to the same number.
COLLAPSE_STEPS = 3
FLAGS = 3  # loss not finite (ranks), gradient norm not finite, gradient norm zero
COLLAPSE, NO_SIGNAL = "collapse", "no_learning_signal"  # the kinds of Finding


class NonFiniteError(RuntimeError):
    """A step's loss or gradient norm was NaN or inf and ``on_nonfinite`` is ``stop``."""


class CollapseError(RuntimeError):
    """The run learned nothing for ``COLLAPSE_STEPS`` steps (a collapse, or no learning signal) and ``on_collapse``
    is ``stop``."""


@dataclass(frozen=True, kw_only=True)
class Finding:
    """A run that stopped learning: what was found, over which steps, and what the run did about it.

    ``kind``: ``collapse`` (gradient norm exactly 0) or ``no_learning_signal`` (a method's step had nothing to
    learn from, e.g. GRPO without a usable reward); ``first_step``..``step``: the steps it covers; ``action``:
    ``stopped`` or ``warned`` (``on_collapse``); ``message``: the log line.
    """

    kind: str
    first_step: int
    step: int
    action: str
    message: str

    def record(self) -> dict[str, Any]:
        """The metrics.jsonl / summary.json form (``event`` marks it apart from the step records)."""
        return {"event": self.kind, **asdict(self)}


class NonFiniteGuard:
    """Watches every step's loss and gradient norm (every rank holds one, attached to its optimizer).

    Args:
        mode: ``stop`` or ``skip_step`` (``on_nonfinite``).
        last_step: the step before the first this process runs (0, or the step resumed from).
        last_good: called on every rank when the run stops; says which checkpoint to continue from. A collapse
            passes ``before``: the newest checkpoint at or before that step is the last good one.
        on_collapse: ``stop`` or ``warn``: what a run that learns nothing does (module docstring).
        report: called on every rank with each :class:`Finding`, before the run stops or goes on (the run writes
            it to metrics.jsonl and keeps it for the summary and the model card).
    """

    def __init__(
        self,
        mode: str,
        *,
        last_step: int = 0,
        last_good: Callable[..., str] | None = None,
        on_collapse: str = "stop",
        report: Callable[[Finding], None] | None = None,
    ) -> None:
        if mode not in ON_NONFINITE:
            raise ValueError(f"on_nonfinite={mode!r}: use one of {', '.join(ON_NONFINITE)}")
        if on_collapse not in ON_COLLAPSE:
            raise ValueError(f"on_collapse={on_collapse!r}: use one of {', '.join(ON_COLLAPSE)}")
        self.mode, self.step, self.last_good = mode, last_step, last_good
        self.on_collapse, self.report = on_collapse, report
        self.pending: torch.Tensor | None = None  # the last step's flags, not yet read
        self.pending_step, self.pending_tokens = 0, 0
        self.skipped: list[int] = []  # steps whose update was skipped (skip_step)
        self.zero_streak = 0
        self.findings: list[Finding] = []
        # Steps without a learning signal (no_signal): their zero gradient is explained, not a collapse.
        self.silent_streak, self.silent_now, self.pending_silent = 0, False, False

    def before_update(
        self,
        optimizer: torch.optim.Optimizer,
        loss_sum: torch.Tensor,
        grad_norm: torch.Tensor,
        target_tokens: int,
    ) -> bool:
        """Record this step's flags (on the device) and arm the optimizer; False: skip ``optimizer.step()``.

        Every rank calls it once per step, between the clip and the optimizer step.
        """
        self.step += 1
        norm = grad_norm.detach().float().reshape(1)
        bad_norm = ~torch.isfinite(norm)
        loss_bad = ~torch.isfinite(loss_sum.detach().float().reshape(1).to(norm.device))
        self.pending = torch.cat([loss_bad, bad_norm, norm == 0]).long()
        self.pending_step, self.pending_tokens = self.step, target_tokens
        self.pending_silent = self.silent_now
        inner = optimizer
        while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
            inner = inner.optimizer  # type: ignore[attr-defined]  # accelerate's AcceleratedOptimizer wraps it
        if inner.defaults.get("fused"):
            # Decided on the device: the fused kernel leaves everything unchanged when found_inf is 1.
            inner.found_inf = bad_norm.float().reshape(())  # type: ignore[attr-defined]
            return True
        if self.mode == "skip_step":  # another optimizer: one more host read per step (documented)
            return bool(torch.isfinite(norm).all())
        return True

    def fold(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` (a step's host counts on the device) with the pending flags appended, to be summed over the
        ranks and read with it: the flags cost no read of their own."""
        if self.pending is None:
            return local
        return torch.cat([local, self.pending.to(local.device, local.dtype)])

    def settle(self, values: Sequence[int]) -> None:
        """Act on the pending step's flags summed over the ranks (``values``: what :meth:`fold` appended, read
        back; empty when nothing was pending). Every rank gets the same values and takes the same branch.

        Raises:
            NonFiniteError: a non-finite step with ``on_nonfinite: stop``.
        """
        if self.pending is None:
            return
        self.pending = None
        loss_ranks, norm_bad, norm_zero = (int(v) for v in values[:FLAGS])
        step = self.pending_step
        if loss_ranks or norm_bad:
            what = " and ".join(
                w
                for w, on in (
                    (f"the loss (on {loss_ranks} rank(s))", loss_ranks),
                    ("the gradient norm", norm_bad),
                )
                if on
            )
            if self.mode == "stop":
                where = self.last_good() if self.last_good is not None else ""
                verb = "are" if loss_ranks and norm_bad else "is"
                raise NonFiniteError(
                    f"step {step}: {what} {verb} not finite (NaN or inf): the run diverged and stopped at step {step}; "
                    f"no checkpoint of that state was written. {where}Lower learning_rate (or raise warmup_steps, "
                    "keep max_grad_norm > 0), or set on_nonfinite: skip_step to skip such steps"
                )
            verb = "are" if loss_ranks and norm_bad else "is"
            skipped = bool(norm_bad)
            if skipped:
                self.skipped.append(step)
            logger.warning(
                "step %d: %s %s not finite: %s (%d step(s) skipped so far)",
                step,
                what,
                verb,
                "its optimizer update was skipped" if skipped else "its gradient was finite and was applied",
                len(self.skipped),
            )
        if norm_zero and self.pending_tokens > 0 and not norm_bad and not self.pending_silent:
            self.zero_streak += 1
            if self.zero_streak == COLLAPSE_STEPS:
                first = step - COLLAPSE_STEPS + 1
                self._learned_nothing(
                    COLLAPSE,
                    first,
                    step,
                    f"COLLAPSE: the gradient norm has been exactly 0 for {COLLAPSE_STEPS} steps in a row (steps "
                    f"{first}..{step}) although the steps have target tokens: the model has collapsed (a constant "
                    "output; the loss stays near ln(vocab size)) and is learning nothing",
                    # The weights that gave step `first` its zero gradient are those after step first - 1.
                    good_before=first - 2,
                    fix="Lower learning_rate (or raise warmup_steps, keep max_grad_norm > 0)",
                )
        else:
            self.zero_streak = 0

    def no_signal(self, step: int, silent: bool, describe: Callable[[], str], fix: str) -> None:
        """A method's step ``step`` had (``silent``) or had not a learning signal; after ``COLLAPSE_STEPS`` silent
        steps in a row the run stops or warns as on a collapse (``describe()``: what was wrong, its causes named;
        ``fix``: what to do).

        Every rank calls it once per step, before the step's updates, with ``silent`` decided from values summed
        over the ranks (the same on every rank). The zero gradients of silent steps are not counted as a collapse.

        Raises:
            CollapseError: the ``COLLAPSE_STEPS``-th silent step in a row with ``on_collapse: stop``.
        """
        self.silent_now = silent
        if not silent:
            self.silent_streak = 0
            return
        self.silent_streak += 1
        if self.silent_streak == COLLAPSE_STEPS:
            first = step - COLLAPSE_STEPS + 1
            self._learned_nothing(
                NO_SIGNAL,
                first,
                step,
                f"no learning signal for {COLLAPSE_STEPS} steps in a row (steps {first}..{step}): {describe()}",
                good_before=None,  # nothing was learned, nothing was spoiled: the newest checkpoint is good
                fix=fix,
            )

    def _learned_nothing(
        self, kind: str, first: int, step: int, what: str, *, good_before: int | None, fix: str
    ) -> None:
        """Record a :class:`Finding`, report it, then stop (raise, every rank) or warn (rank 0, once)."""
        stop = self.on_collapse == "stop"
        finding = Finding(
            kind=kind, first_step=first, step=step, action="stopped" if stop else "warned", message=what
        )
        self.findings.append(finding)
        if self.report is not None:
            self.report(finding)
        if stop:
            where = ""
            if self.last_good is not None:
                where = self.last_good() if good_before is None else self.last_good(good_before)
            raise CollapseError(
                f"{what}; the run stopped at step {step} and exports nothing. {where}{fix}. on_collapse: warn lets "
                "such a run go on (it is then marked in metrics.jsonl, summary.json and the model card)"
            )
        if collectives.rank() == 0:  # the decision is every rank's; the line is said once
            logger.warning(
                "%s. on_collapse is warn: the run goes on, marked as such in metrics.jsonl, summary.json and the "
                "model card of its export. %s",
                what,
                fix,
            )

    def settle_now(self) -> None:
        """Read the pending flags now (every rank; one all-reduce and one read): before a save or the end.

        Raises:
            NonFiniteError: as :meth:`settle`.
        """
        if self.pending is None:
            return
        # Every rank: the flags are on the model's device, where the default group's collectives take them.
        summed = collectives.all_reduce_sum(self.pending.clone())
        self.settle(summed.tolist())


_GUARDS: weakref.WeakKeyDictionary[torch.optim.Optimizer, NonFiniteGuard] = weakref.WeakKeyDictionary()


def attach(optimizer: torch.optim.Optimizer, guard: NonFiniteGuard) -> NonFiniteGuard:
    """Make ``guard`` the one the training step of ``optimizer`` reports to.

    The guard belongs to the optimizer it arms: the run's state (checkpoints, resume step) creates it after the
    objective has built its step function, and every step function finds it through its optimizer.
    """
    _GUARDS[optimizer] = guard
    return guard


def guard_of(optimizer: torch.optim.Optimizer) -> NonFiniteGuard | None:
    """The guard attached to ``optimizer``, or None (benches and tests that call the step directly)."""
    return _GUARDS.get(optimizer)
