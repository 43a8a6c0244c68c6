"""The training step every method runs: the skeleton (accumulation, gradient sync, scaling by the step's global
counts, clipping, the update) here, the loss of a micro-batch from the method (:class:`StepLoss`).

One optimizer step over a rank's micro-batches:

1. the method's host counts of every micro-batch (target tokens, pairs, examples ...) summed over every rank in one
   all-reduce, the step's one host read (:func:`read_step_counts`);
2. per micro-batch: the gradient-sync choice (FSDP2 reduce-scatters after every micro-batch or only the last), the
   method's forward and loss (:meth:`StepLoss.micro`), and the backward of each of its terms' ``local SUM x ranks /
   global count`` (FSDP2 averages over the ``ranks`` that reduce gradients, so the accumulated gradient is that of the
   step's mean over every micro-batch of every rank), plus the MoE router loss when the method returns one;
3. gradient clipping over the sharded gradients, the optimizer and scheduler step (:func:`clip_and_update`).

The contract a method's loss meets (torchtitan's "local SUM loss / global valid tokens"): :meth:`StepLoss.micro`
returns SUMS over this rank's micro-batch and the global count each is divided by; it never divides by a local
count, so micro-batches and ranks of unequal size weigh by what they hold. Every rank runs the same collectives in
the same order whatever its data: micro-batches of any size, with or without targets, take the same path. The phases
carry ``hf_fsdp2/<phase>`` labels in profiler traces (``profile_steps``; bench/step_profile.py sums them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.profiler import record_function

from hf_fsdp2 import collectives
from hf_fsdp2.parallel.all_to_all import pad_to_multiple, shard_sequence
from hf_fsdp2.parallel.ring import ring_context, ring_mesh, shard_ring
from hf_fsdp2.train.loss import LossPlan, causal_lm_loss, count_target_tokens, shifted_target_rows
from hf_fsdp2.train.nonfinite import NonFiniteGuard, guard_of
from hf_fsdp2.train.router import RouterLoss

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class StepSettings:
    """How a step runs, for every method (from the train and fsdp config sections).

    Attributes:
        loss: the run's loss plan (:func:`~hf_fsdp2.train.loss.plan_loss`): chunked head, logit transform, router loss.
        max_grad_norm: clip the global gradient norm to this; 0 = no clipping (the norm is still measured).
        sync_each_microbatch: reduce-scatter gradients after every micro-batch (sharded gradients in
            memory) rather than only after the last (less traffic, full-size unsharded gradients kept).
    """

    loss: LossPlan
    max_grad_norm: float = 1.0
    sync_each_microbatch: bool = True


@dataclass(frozen=True)
class StepCounts:
    """A step's global counts, the same on every rank (read once, :func:`read_step_counts`).

    Attributes:
        loss_count: what the logged loss sum (summed over ranks) is divided by: target tokens, pairs, examples
            (1 when the method's logged sum is already normalised: GRPO).
        loss_units: the step's loss units (tokens, pairs, examples): a zero gradient with none is expected, with
            some it is a collapse (the non-finite guard's reading).
        target_tokens: tokens that carry the loss, over every rank and micro-batch.
        processed_tokens: tokens fed to the model (padding included), over every rank and micro-batch.
    """

    loss_count: int
    loss_units: int
    target_tokens: int
    processed_tokens: int


@dataclass(frozen=True)
class LossTerm:
    """One term of a micro-batch's loss: ``weight x numerator / count`` of the step's mean.

    Attributes:
        numerator: this rank's SUM over the micro-batch (with its graph); never divided by a local count.
        count: the step's GLOBAL count the sum is divided by (over every rank and micro-batch); 0 = nothing to
            learn on any rank: the same backward, a zero gradient.
        weight: the term's weight in the step's loss.
    """

    numerator: torch.Tensor
    count: float
    weight: float = 1.0

    def scaled(self, ranks: int) -> torch.Tensor:
        """The term as backpropagated: FSDP2 averages gradients over ``ranks``, which ``ranks / count`` undoes."""
        scale = self.weight * ranks / self.count if self.count > 0 else 0.0
        return self.numerator * scale


@dataclass(frozen=True)
class MicroLoss:
    """What a method's loss gives for one micro-batch.

    Attributes:
        terms: the loss terms, backpropagated as their sum (in this order).
        logged: detached values added, in this order, to the step's logged loss sum (:attr:`StepOutput.loss_sum`).
        aux: the forward's MoE router loss (None: no router loss for this method or model).
    """

    terms: tuple[LossTerm, ...]
    logged: tuple[torch.Tensor, ...]
    aux: torch.Tensor | None = None


class StepLoss:
    """A method's loss for ONE step (a new one per step: it may keep the step's metric sums). A method overrides
    :meth:`local_counts`, :meth:`begin` and :meth:`micro`, and where it needs them the others.

    The skeleton calls, on every rank: :meth:`prepare`, :meth:`local_counts`, :meth:`begin` with the global counts,
    then per micro-batch :meth:`micro` inside :meth:`scope`, and :meth:`metrics` when the step is logged.
    """

    log_dtype: torch.dtype = torch.float64  # the dtype the step's logged loss sum accumulates in

    def prepare(self, micro_batches: Sequence[Batch]) -> Sequence[Batch]:
        """This rank's micro-batches as the step computes them (a context-parallel part of each sequence)."""
        return micro_batches

    def local_counts(self, micro_batches: Sequence[Batch]) -> list[int]:
        """This rank's host counts (summed over the ranks into :meth:`begin`'s ``counts``); no device read."""
        raise NotImplementedError

    def begin(self, counts: Sequence[int], guard: NonFiniteGuard | None) -> StepCounts:
        """The step's global counts (:meth:`local_counts` summed over every rank) -> what the step reports."""
        raise NotImplementedError

    def scope(self) -> AbstractContextManager[Any]:
        """What a micro-batch's forward and backward run inside (ring attention's context)."""
        return contextlib.nullcontext()

    def micro(self, model: torch.nn.Module, batch: Batch, index: int) -> MicroLoss:
        """Forward and loss of micro-batch ``index`` (host tensors; the method moves them to the device)."""
        raise NotImplementedError

    def metrics(self, micro_batches: int) -> dict[str, float]:
        """The method's own metrics of the step (collective when it has any: every rank calls it)."""
        return {}


@dataclass(kw_only=True)
class StepOutput:
    """What a step did; the loop and the observer read these fields. Tensors stay on the device: reading them waits
    for the device (log steps only).

    Attributes:
        loss_sum: this rank's logged loss sum (``loss_sum`` summed over ranks / ``loss_count`` is the step's loss).
        loss_count: what the summed loss is divided by.
        aux_sum: this rank's summed router loss over its micro-batches (None without one).
        target_tokens: target tokens of the step over all ranks and micro-batches.
        processed_tokens: tokens fed to the model (padding included) over all ranks and micro-batches.
        grad_norm: global gradient norm before clipping.
        lr: learning rate the step used.
        trained: the rows the step trained on (what the meter counts): its micro-batches.
        method_metrics: the method's metrics of the step (collective): :meth:`StepLoss.metrics`.
    """

    loss_sum: torch.Tensor
    loss_count: int
    aux_sum: torch.Tensor | None
    target_tokens: int
    processed_tokens: int
    grad_norm: torch.Tensor
    lr: float
    trained: Sequence[Batch] = ()
    method_metrics: Callable[[int], dict[str, float]] | None = field(default=None, repr=False)

    def extra_metrics(self, micro_batches: int) -> dict[str, float]:
        """The method's metrics and the mean router loss (collective when there is any: every rank calls it)."""
        out = self.method_metrics(micro_batches) if self.method_metrics is not None else {}
        aux = self.aux_loss(micro_batches)
        if aux is not None:
            out["aux_loss"] = aux
        return out

    def loss(self) -> float:
        """The step's loss: the logged sum over every rank / the loss count (collective: every rank calls it)."""
        total = collectives.all_reduce_sum(self.loss_sum.detach().double().reshape(1).clone())
        return float(total[0]) / collectives.tp_size() / max(self.loss_count, 1)

    def aux_loss(self, micro_batches: int) -> float | None:
        """The step's mean router loss over every micro-batch of every rank (collective), or None."""
        if self.aux_sum is None:
            return None
        total = collectives.all_reduce_sum(self.aux_sum.detach().double().reshape(1).clone())
        return float(total[0]) / (micro_batches * collectives.world())


class Step(Protocol):
    """What the loop runs each optimizer step: ``step(micro_batches) -> StepOutput``, how many batches of the data
    stream a step reads, and the state it keeps across steps (checkpointed with each rank's data position)."""

    def __call__(self, micro_batches: Sequence[Batch], /) -> StepOutput: ...

    def reads(self, step: int, /) -> int:
        """Stream batches ``step`` reads (every rank the same)."""
        ...

    def buffer_state(self) -> dict[str, Any] | None:
        """What a checkpoint keeps of this rank's buffer across steps (None: no buffer)."""
        ...

    def load_buffer(self, state: dict[str, Any], /) -> None:
        """The buffer of a resumed checkpoint (before the first step)."""
        ...


def to_device(batch: Batch, device: torch.device) -> Batch:
    """A micro-batch's tensors on ``device`` (host-to-device copies queued without waiting)."""
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
    loss_units: int,
) -> None:
    """The optimizer step (unless the run's non-finite guard skips it), the schedule, and zeroed gradients."""
    guard = guard_of(optimizer)  # the run's on_nonfinite watch (hf_fsdp2.train.nonfinite), when attached
    if guard is None or guard.before_update(optimizer, loss_sum, grad_norm, loss_units):
        optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def choose_gradient_sync(model: torch.nn.Module, index: int, count: int, sync_each_microbatch: bool) -> None:
    """Whether FSDP2 reduce-scatters micro-batch ``index`` (of ``count``)'s gradients after its backward: every
    micro-batch's, or only the last's (no-op on a model that is not FSDP2-sharded). Every rank makes the same
    choice."""
    set_sync = getattr(model, "set_requires_gradient_sync", None)
    if callable(set_sync):
        set_sync(sync_each_microbatch or index == count - 1)


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm (DTensor gradients included); returns the norm before clipping. Each mesh's
    gradients (expert parallel: the experts' on ``efsdp x ep``, the rest on the run's mesh) are reduced on their own
    (collective over its ranks): DTensors of two meshes cannot be stacked."""
    by_mesh: dict[Any, list[torch.nn.Parameter]] = {}
    for param in model.parameters():
        if param.grad is not None:
            by_mesh.setdefault(getattr(param.grad, "device_mesh", None), []).append(param)
    norms = [
        torch.nn.utils.get_total_norm([p.grad for p in ps if p.grad is not None]) for ps in by_mesh.values()
    ]
    norms = [n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    limit = max_norm if max_norm > 0 else float("inf")
    for params in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(params, limit, total)
    return total


def clip_and_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    loss_sum: torch.Tensor,
    max_grad_norm: float,
    loss_units: int,
) -> tuple[torch.Tensor, float]:
    """A step's end once its gradients are accumulated: clip (:func:`clip_grad_norm`), then :func:`apply_update`.
    Every rank calls it.

    Returns:
        The gradient norm before clipping, and the learning rate the step used.
    """
    with record_function("hf_fsdp2/clip_grad_norm"):
        grad_norm = clip_grad_norm(model, max_grad_norm)
    lr = float(optimizer.param_groups[0]["lr"])
    with record_function("hf_fsdp2/optimizer_step"):
        apply_update(optimizer, scheduler, loss_sum, grad_norm, loss_units)
    return grad_norm, lr


@dataclass
class Accumulated:
    """What :func:`forward_backward` leaves: the step's counts, this rank's logged loss and router loss sums."""

    counts: StepCounts
    loss_sum: torch.Tensor
    aux_sum: torch.Tensor | None
    micro_batches: Sequence[Batch]


def forward_backward(
    model: torch.nn.Module,
    micro_batches: Sequence[Batch],
    settings: StepSettings,
    device: torch.device,
    guard: NonFiniteGuard | None = None,
    loss: StepLoss | None = None,
) -> Accumulated:
    """Forward and backward of one step's micro-batches with the method's ``loss`` (None: :class:`TokenLoss`);
    gradients accumulate in the model.

    ``guard``: the previous step's non-finite/collapse flags are summed and read with this step's counts (no read of
    their own), and acted on before any forward is queued. Every rank calls it with its own micro-batches.
    """
    loss = loss if loss is not None else TokenLoss(settings.loss, device, model)
    batches = loss.prepare(micro_batches)
    with record_function("hf_fsdp2/count_tokens"):
        local = torch.tensor(loss.local_counts(batches), dtype=torch.long, device=device)
        counts = loss.begin(read_step_counts(local, guard), guard)
    ranks = collectives.grad_world()
    router = RouterLoss(settings.loss.router_aux_coef, len(batches), device, ranks)
    loss_sum = torch.zeros((), dtype=loss.log_dtype, device=device)
    for i, batch in enumerate(batches):
        choose_gradient_sync(model, i, len(batches), settings.sync_each_microbatch)
        with loss.scope():  # the backward too: ring attention's gradients pass around the group as well
            with record_function("hf_fsdp2/forward_loss"):
                part = loss.micro(model, batch, i)
                total = part.terms[0].scaled(ranks)
                for term in part.terms[1:]:
                    total = total + term.scaled(ranks)
                total = router.added(total, part.aux)
            with record_function("hf_fsdp2/backward"):
                total.backward()
        for value in part.logged:
            loss_sum += value
        del part, total
    return Accumulated(counts, loss_sum, router.sum, batches)


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    micro_batches: Sequence[Batch],
    settings: StepSettings,
    device: torch.device,
    loss: StepLoss | None = None,
    trained: Sequence[Batch] | None = None,
) -> StepOutput:
    """One optimizer step over ``micro_batches`` (every rank calls it, with its own micro-batches).

    Args:
        model: the (FSDP2-sharded) model, in train mode.
        optimizer: its optimizer.
        scheduler: the learning-rate schedule, stepped after the optimizer (None: constant).
        micro_batches: this rank's micro-batches of the step (collated, on the host or the device).
        settings: loss plan, clipping, gradient sync.
        device: where the model computes.
        loss: the method's loss for this step (None: the token-level cross entropy, :class:`TokenLoss`).
        trained: the rows the meter counts (None: ``micro_batches``).

    Returns:
        The :class:`StepOutput`.
    """
    loss = loss if loss is not None else TokenLoss(settings.loss, device, model)
    guard = guard_of(optimizer)  # the run's on_nonfinite watch (hf_fsdp2.train.nonfinite), when attached
    acc = forward_backward(model, micro_batches, settings, device, guard, loss)
    c = acc.counts
    grad_norm, lr = clip_and_update(
        model, optimizer, scheduler, acc.loss_sum, settings.max_grad_norm, c.loss_units
    )
    return StepOutput(
        loss_sum=acc.loss_sum,
        loss_count=c.loss_count,
        aux_sum=acc.aux_sum,
        target_tokens=c.target_tokens,
        processed_tokens=c.processed_tokens,
        grad_norm=grad_norm,
        lr=lr,
        trained=list(trained if trained is not None else micro_batches),
        method_metrics=loss.metrics,
    )


class TokenLoss(StepLoss):
    """SFT's and CPT's loss: the summed next-token cross entropy over the step's target tokens, divided by the
    step's global target tokens. Under context parallel each rank computes its part of every sequence (all-to-all,
    or torch's ring attention on CUDA); under tensor parallel a group's ranks hold the same batch and count it once.
    """

    log_dtype = torch.float32

    def __init__(self, plan: LossPlan, device: torch.device, model: torch.nn.Module) -> None:
        self.plan, self.device = plan, device
        # Ring attention: torch's load-balanced layout and context (None: all-to-all, or no context parallel).
        self.ring = ring_mesh(model) if collectives.cp_size() > 1 else None
        self.tokens = 0

    def prepare(self, micro_batches: Sequence[Batch]) -> Sequence[Batch]:
        cp, tp = collectives.cp_size(), collectives.tp_size()
        if cp <= 1:
            return micro_batches
        # Context parallel: this rank's part of each sequence (its labels one column wider); under tensor parallel
        # too, parts whose length is a multiple of tp (sequence parallel splits them further).
        if self.ring is not None:
            return [shard_ring(b, cp, collectives.cp_rank()) for b in micro_batches]
        return [shard_sequence(pad_to_multiple(b, cp * tp), cp, collectives.cp_rank()) for b in micro_batches]

    def local_counts(self, micro_batches: Sequence[Batch]) -> list[int]:
        # The step's target tokens normalise the loss; with the processed count they give its padding efficiency.
        return [
            sum(count_target_tokens(b["labels"]) for b in micro_batches),
            sum(b["input_ids"].numel() for b in micro_batches),
        ]

    def begin(self, counts: Sequence[int], guard: NonFiniteGuard | None) -> StepCounts:
        # A tensor-parallel group's ranks hold the same batch: each counted it once.
        tokens, processed = (v // collectives.tp_size() for v in counts)
        self.tokens = tokens
        return StepCounts(
            loss_count=tokens, loss_units=tokens, target_tokens=tokens, processed_tokens=processed
        )

    def scope(self) -> AbstractContextManager[Any]:
        return ring_context(self.ring) if self.ring is not None else contextlib.nullcontext()

    def micro(self, model: torch.nn.Module, batch: Batch, index: int) -> MicroLoss:
        if collectives.tp_size() > 1 and collectives.cp_size() <= 1:
            # Sequence parallel splits a length that is a multiple of tp (padding: no target, not counted above).
            batch = pad_to_multiple(batch, collectives.tp_size())
        # The chunked loss's target positions from the host labels: finding them on the device would wait for it.
        rows = shifted_target_rows(batch["labels"]) if self.plan.chunk_tokens > 0 else None
        batch = to_device(batch, self.device)
        # The collator decides the inputs: attention_mask for padded batches, position_ids alone for packed
        # or padding-free ones, which transformers honours only without a KV cache.
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        out = causal_lm_loss(model, inputs, batch["labels"], self.plan, rows)
        return MicroLoss((LossTerm(out.ce_sum, self.tokens),), (out.ce_sum.detach().float(),), out.aux_loss)


class LossStep:
    """The :class:`Step` of a method whose micro-batches come straight from its data stream (SFT, CPT, DPO, KTO,
    reward models): each step reads ``gradient_accumulation_steps`` batches and runs :func:`train_step` with a new
    loss of the method's (``new_loss``); nothing is kept across steps."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        *,
        settings: StepSettings,
        device: torch.device,
        new_loss: Callable[[], StepLoss],
        reads_per_step: int,
    ) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.settings, self.device, self.new_loss = settings, device, new_loss
        self.reads_per_step = reads_per_step

    def __call__(self, micro_batches: Sequence[Batch]) -> StepOutput:
        return train_step(
            self.model,
            self.optimizer,
            self.scheduler,
            micro_batches,
            self.settings,
            self.device,
            self.new_loss(),
        )

    def reads(self, step: int) -> int:
        return self.reads_per_step

    def buffer_state(self) -> dict[str, Any] | None:
        return None

    def load_buffer(self, state: dict[str, Any]) -> None:
        raise ValueError("this method's step keeps no buffer across steps; the checkpoint holds one")
