"""Non-finite steps and collapse: found at every step without an extra wait for the device.

After each step's backward and clip, the step's flags are computed on the device, on every rank:
``[loss not finite (this rank), gradient norm not finite, gradient norm exactly 0]`` (the norm is global, the
same on every rank). Nothing is read then. The flags ride along with the next step's one all-reduce and host
read of its token counts (:func:`hf_fsdp2.train.step.forward_backward`), which sums them over the ranks: every
rank reads the same numbers at the same point, before the next step's forward is queued, and takes the same
branch. Steps that already read the device (a save, the last step, a SIGTERM stop) read the flags first
(:meth:`NonFiniteGuard.settle_now`), so a checkpoint is never written of a state after a non-finite step.

Why not read the flags at once: that read would wait for the whole backward at every step (issue 23 made a
step read the device exactly once). The price is that ``stop`` notices step N at the start of step N+1 -- before
any of its work -- or at step N's save.

The update of a non-finite step is never applied where the optimizer allows deciding it on the device: the
fused AdamW (CUDA and CPU, this project's default) takes ``found_inf`` (as under torch.amp.GradScaler) and
leaves weights, moments and step count unchanged when it is 1. With another optimizer, ``skip_step`` reads the
norm before the update (one more host read per step, documented), and ``stop`` lets the update happen: the
poisoned state is then never saved, the run stops before another step runs.

The learning-rate schedule advances on a skipped step (as in torch.amp GradScaler loops and the step-indexed
schedules of torchtitan): the schedule stays a function of the step number and of the data position, so a
resume reproduces it.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence

import torch

from hf_fsdp2 import collectives

logger = logging.getLogger("hf_fsdp2")

ON_NONFINITE = ("stop", "skip_step")
# Consecutive steps with a gradient norm of exactly 0 while there are target tokens before the collapse
# warning: a real gradient over millions of weights is never exactly 0; a collapsed model (a constant output,
# loss = ln(vocab)) or an all-frozen one gives exactly 0 at every step.
COLLAPSE_STEPS = 3
FLAGS = 3  # loss not finite (ranks), gradient norm not finite, gradient norm zero


class NonFiniteError(RuntimeError):
    """A step's loss or gradient norm was NaN or inf and ``on_nonfinite`` is ``stop``."""


class NonFiniteGuard:
    """Watches every step's loss and gradient norm (every rank holds one, attached to its optimizer).

    Args:
        mode: ``stop`` or ``skip_step``.
        last_step: the step before the first this process runs (0, or the step resumed from).
        last_good: called on every rank when the run stops; says which checkpoint to continue from.
    """

    def __init__(self, mode: str, *, last_step: int = 0, last_good: Callable[[], str] | None = None) -> None:
        if mode not in ON_NONFINITE:
            raise ValueError(f"on_nonfinite={mode!r}: use one of {', '.join(ON_NONFINITE)}")
        self.mode, self.step, self.last_good = mode, last_step, last_good
        self.pending: torch.Tensor | None = None  # the last step's flags, not yet read
        self.pending_step, self.pending_tokens = 0, 0
        self.skipped: list[int] = []  # steps whose update was skipped (skip_step)
        self.zero_streak = 0

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
        if norm_zero and self.pending_tokens > 0 and not norm_bad:
            self.zero_streak += 1
            if self.zero_streak == COLLAPSE_STEPS:
                logger.warning(
                    "COLLAPSE: the gradient norm has been exactly 0 for %d steps in a row (up to step %d) although "
                    "the steps have target tokens: the model has collapsed (a constant output; the loss stays near "
                    "ln(vocab size)) and is learning nothing. Stop the run and lower learning_rate; an export of it "
                    "is useless",
                    COLLAPSE_STEPS,
                    step,
                )
        else:
            self.zero_streak = 0

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
