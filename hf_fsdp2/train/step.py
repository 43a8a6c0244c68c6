"""The training step every recipe, bench and test calls: token-normalised accumulation, clip, step.

One optimizer step over ``gradient_accumulation_steps`` micro-batches on every rank:

1. one all-reduce of (target tokens, processed tokens) over every micro-batch of every rank;
2. per micro-batch: forward + loss by the run's :class:`~hf_fsdp2.train.loss.LossPlan` (never chosen per
   batch), backward of ``summed CE x world / global target tokens`` (FSDP2 averages over ranks, so the
   accumulated gradient is the gradient of the step's global token mean), plus the MoE router loss
   when the plan has one; FSDP2 reduce-scatters on every micro-batch or only the last;
3. gradient clipping over the sharded gradients, optimizer and scheduler step.

Every rank runs the same collectives in the same order whatever its data: micro-batches of any size,
with or without target tokens, take the same path. The phases carry ``hf_fsdp2/<phase>`` labels in profiler
traces (``profile_steps``; bench/step_profile.py sums them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from hf_fsdp2 import collectives
from hf_fsdp2.parallel.context import shard_sequence
from hf_fsdp2.parallel.ring import ring_context, ring_mesh, shard_ring
from hf_fsdp2.train.loss import (
    LossPlan,
    backward_scale,
    causal_lm_loss,
    count_target_tokens,
    shifted_target_rows,
)
from hf_fsdp2.train.nonfinite import NonFiniteGuard, guard_of


@dataclass(frozen=True)
class StepSettings:
    """How a step runs (from the train config section).

    Attributes:
        loss: the run's loss plan (:func:`~hf_fsdp2.train.loss.plan_loss`).
        max_grad_norm: clip the global gradient norm to this; 0 = no clipping (the norm is still measured).
        sync_each_microbatch: reduce-scatter gradients after every micro-batch (sharded gradients in
            memory) rather than only after the last (less traffic, full-size unsharded gradients kept).
    """

    loss: LossPlan
    max_grad_norm: float = 1.0
    sync_each_microbatch: bool = True


@dataclass
class StepOutput:
    """What a step did. Tensors stay on the device: reading them waits for the device (log steps only).

    Attributes:
        loss_sum: this rank's summed CE over its target tokens (all micro-batches).
        aux_sum: this rank's summed router loss over its micro-batches (None without one).
        target_tokens: target tokens of the step over all ranks and micro-batches.
        processed_tokens: tokens fed to the model (padding included) over all ranks and micro-batches.
        grad_norm: global gradient norm before clipping.
        lr: learning rate the step used.
    """

    loss_sum: torch.Tensor
    aux_sum: torch.Tensor | None
    target_tokens: int
    processed_tokens: int
    grad_norm: torch.Tensor
    lr: float

    @property
    def loss_count(self) -> int:
        """What the summed loss is divided by: the step's target tokens."""
        return self.target_tokens

    def extra_metrics(self, micro_batches: int) -> dict[str, float]:
        """The router loss when the model has one (collective when it has: every rank calls it)."""
        aux = self.aux_loss(micro_batches)
        return {} if aux is None else {"aux_loss": aux}

    def loss(self) -> float:
        """The step's loss: summed CE over every rank / target tokens (collective: every rank calls it)."""
        total = collectives.all_reduce_sum(self.loss_sum.detach().double().reshape(1).clone())
        return float(total[0]) / collectives.tp_size() / max(self.target_tokens, 1)

    def aux_loss(self, micro_batches: int) -> float | None:
        """The step's mean router loss over every micro-batch of every rank (collective), or None."""
        if self.aux_sum is None:
            return None
        total = collectives.all_reduce_sum(self.aux_sum.detach().double().reshape(1).clone())
        return float(total[0]) / (micro_batches * collectives.world())


def _to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def read_step_counts(local: torch.Tensor, guard: NonFiniteGuard | None) -> list[int]:
    """A step's host counts (``local``, on the device) summed over every rank and read: the step's one host sync,
    before any forward is queued. With a guard, the previous step's non-finite flags ride along (no read of their
    own) and are acted on here: every rank reads the same values and stops (raises) or goes on at this point.
    Every rank calls it once per step.
    """
    n = local.numel()
    values = collectives.all_reduce_sum(guard.fold(local) if guard is not None else local).tolist()
    if guard is not None:
        guard.settle(values[n:])
    return [int(v) for v in values[:n]]


def apply_update(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    loss_sum: torch.Tensor,
    grad_norm: torch.Tensor,
    target_count: int,
) -> None:
    """The optimizer step (unless the run's non-finite guard skips it), the schedule, and zeroed gradients."""
    guard = guard_of(optimizer)  # the run's on_nonfinite watch (hf_fsdp2.train.nonfinite), when attached
    if guard is None or guard.before_update(optimizer, loss_sum, grad_norm, target_count):
        optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)


class RouterLoss:
    """A step's MoE router loss: added to each micro-batch's backward objective as a mean over every micro-batch
    of every rank (FSDP2 averages over ranks), and this rank's sum kept for the log (``sum``: None when the loss
    plan has no router loss)."""

    def __init__(self, coef: float, micro_batches: int, device: torch.device) -> None:
        self.scale = coef / micro_batches
        self.sum = torch.zeros((), dtype=torch.float32, device=device) if coef else None

    def added(self, total: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        """``total`` plus this micro-batch's scaled router loss ``aux`` (counted in :attr:`sum`), or ``total``."""
        if aux is None or self.sum is None:
            return total
        self.sum += aux.detach().float()
        return total + aux * self.scale


def choose_gradient_sync(model: torch.nn.Module, index: int, count: int, sync_each_microbatch: bool) -> None:
    """Whether FSDP2 reduce-scatters micro-batch ``index`` (of ``count``)'s gradients after its backward: every
    micro-batch's, or only the last's (no-op on a model that is not FSDP2-sharded). Every rank makes the same
    choice."""
    set_sync = getattr(model, "set_requires_gradient_sync", None)
    if callable(set_sync):
        set_sync(sync_each_microbatch or index == count - 1)


def clip_and_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    loss_sum: torch.Tensor,
    max_grad_norm: float,
    count: int,
) -> tuple[torch.Tensor, float]:
    """A step's end once its gradients are accumulated: clip (:func:`clip_grad_norm`), then :func:`apply_update`
    (``count``: what the summed loss is divided by, for the non-finite guard). Every rank calls it.

    Returns:
        The gradient norm before clipping, and the learning rate the step used.
    """
    with record_function("hf_fsdp2/clip_grad_norm"):
        grad_norm = clip_grad_norm(model, max_grad_norm)
    lr = float(optimizer.param_groups[0]["lr"])
    with record_function("hf_fsdp2/optimizer_step"):
        apply_update(optimizer, scheduler, loss_sum, grad_norm, count)
    return grad_norm, lr


def forward_backward(
    model: torch.nn.Module,
    micro_batches: Sequence[dict[str, torch.Tensor]],
    settings: StepSettings,
    device: torch.device,
    guard: NonFiniteGuard | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, int, int]:
    """Forward and backward of one step's micro-batches; gradients accumulate in the model.

    ``guard``: the previous step's non-finite/collapse flags are summed and read with this step's token counts
    (no read of their own), and acted on before any forward is queued.

    Returns:
        (this rank's summed CE, summed router loss or None, global target tokens, global processed tokens).
    """
    cp = collectives.cp_size()
    ring = ring_mesh(model) if cp > 1 else None  # ring attention: torch's load-balanced layout and context
    if cp > 1:  # context parallel: this rank's part of each sequence (its labels one column wider)
        shard = shard_ring if ring is not None else shard_sequence
        micro_batches = [shard(b, cp, collectives.cp_rank()) for b in micro_batches]
    with record_function("hf_fsdp2/count_tokens"):
        local = torch.tensor(
            [
                sum(count_target_tokens(b["labels"]) for b in micro_batches),
                sum(b["input_ids"].numel() for b in micro_batches),
            ],
            dtype=torch.long,
            device=device,
        )
        # Every rank: the step's target-token count normalises the loss; with the processed count it gives
        # the step's padding efficiency.
        # A tensor-parallel group's ranks hold the same batch: each counted it once.
        global_tokens, global_processed = (v // collectives.tp_size() for v in read_step_counts(local, guard))
    scale = backward_scale(global_tokens, collectives.grad_world())
    router = RouterLoss(settings.loss.router_aux_coef, len(micro_batches), device)
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    for i, batch in enumerate(micro_batches):
        choose_gradient_sync(model, i, len(micro_batches), settings.sync_each_microbatch)
        # The chunked loss's target positions from the host labels: finding them on the device would wait for it.
        rows = shifted_target_rows(batch["labels"]) if settings.loss.chunk_tokens > 0 else None
        batch = _to_device(batch, device)
        # The collator decides the inputs: attention_mask for padded batches, position_ids alone for packed
        # or padding-free ones, which transformers honours only without a KV cache.
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        with ring_context(ring):  # the backward too: ring attention's gradients pass around the group as well
            with record_function("hf_fsdp2/forward_loss"):
                out = causal_lm_loss(model, inputs, batch["labels"], settings.loss, rows)
                total = router.added(out.ce_sum * scale, out.aux_loss)
            with record_function("hf_fsdp2/backward"):
                total.backward()
        loss_sum += out.ce_sum.detach().float()
        del out, total
    return loss_sum, router.sum, global_tokens, global_processed


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm (DTensor gradients included); returns the norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else float("inf"))
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    micro_batches: Sequence[dict[str, torch.Tensor]],
    settings: StepSettings,
    device: torch.device,
) -> StepOutput:
    """One optimizer step over ``micro_batches`` (every rank calls it, with its own micro-batches).

    Args:
        model: the (FSDP2-sharded) causal LM, in train mode.
        optimizer: its optimizer.
        scheduler: the learning-rate schedule, stepped after the optimizer (None: constant).
        micro_batches: this rank's micro-batches of the step (collated, on the host or the device).
        settings: loss plan, clipping, gradient sync.
        device: where the model computes.

    Returns:
        The :class:`StepOutput`.
    """
    guard = guard_of(optimizer)  # the run's on_nonfinite watch (hf_fsdp2.train.nonfinite), when attached
    loss_sum, aux_sum, tokens, processed = forward_backward(model, micro_batches, settings, device, guard)
    grad_norm, lr = clip_and_update(model, optimizer, scheduler, loss_sum, settings.max_grad_norm, tokens)
    return StepOutput(loss_sum, aux_sum, tokens, processed, grad_norm, lr)
