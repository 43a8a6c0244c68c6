"""Preference optimisation: per-sequence log-probs of the completions, the reference (a frozen sharded copy,
precomputed log-probs, or the LoRA base; none for the reference-free objectives), and the preference step. The
objectives' formulas are :mod:`hf_fsdp2.train.preference_loss`.

A micro-batch holds B pairs as 2B rows, chosen rows then rejected rows (:class:`~hf_fsdp2.data.preference.
PreferenceCollator`), and goes through the policy in one forward. A row's log-prob is the SUM of the log-probs of
its completion tokens (TRL's definition).

The step's loss is the mean over every pair of every micro-batch of every rank: each micro-batch's summed pair
losses are scaled by ``world / global pairs`` before backward (FSDP2 averages over ranks); an objective with an NLL
term (ORPO, SimPO with ``cpo_alpha``) adds the chosen rows' summed NLL (SimPO: their completions; ORPO: prompt and
completion, :func:`nll_labels`) scaled by ``world / global NLL
tokens``. Every rank runs the same forwards whatever its data: the reference forward (or table lookup; none when
reference-free, for every rank alike: the objective is the run's) and the policy forward of each micro-batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from hf_fsdp2 import collectives
from hf_fsdp2.labels import IGNORE_INDEX
from hf_fsdp2.train.chunked_ce import accumulation_dtype, head_input_replaced
from hf_fsdp2.train.loss import LossPlan
from hf_fsdp2.train.nonfinite import NonFiniteGuard, guard_of
from hf_fsdp2.train.preference_loss import METRICS, DPOSettings, metric_sums, pair_losses
from hf_fsdp2.train.step import RouterLoss, choose_gradient_sync, clip_and_update, read_step_counts


def completion_logps(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    labels: torch.Tensor,
    plan: LossPlan,
    *,
    sequence_labels: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per row, the summed log-prob of its completion tokens (``labels != -100``), and the router loss.

    With ``plan.chunk_tokens > 0`` (the plan's probe showed the logits are the head's output after elementwise
    post-processing) a pre-hook on the output head hands it the completion positions only, so logits exist for
    completion tokens only; otherwise the full logits are computed and the completion positions picked.

    The completion positions are found where ``labels`` are: pass the host labels (the steps do) and no device
    tensor is read back, the positions go to the device as integer indices.

    ``sequence_labels`` (host, a superset of ``labels``' positions; ORPO's NLL over the chosen prompt + completion):
    the head also runs on those positions, and the sums come back as ``[2, rows]``: over ``labels``' positions,
    then over ``sequence_labels``'.

    Returns:
        ``[rows]`` (or ``[2, rows]``) log-probs (fp32, fp64 for fp64 models) and the router auxiliary loss (or None).
    """
    extra = {"output_router_logits": True} if plan.router_aux_coef else {}
    targets = (labels if sequence_labels is None else sequence_labels)[:, 1:]
    rows, cols = (targets != IGNORE_INDEX).nonzero(as_tuple=True)  # row-major: the order of a boolean mask
    picked_targets = targets[rows, cols]
    if plan.chunk_tokens > 0:
        head = model.get_output_embeddings()  # type: ignore[operator]

        def completions_only(module: torch.nn.Module, full: torch.Tensor) -> torch.Tensor:
            return full[rows.to(full.device), cols.to(full.device)][None]  # position t predicts token t + 1

        # Through the loss's one head hook (held outside the module): a new hook closure per call would be guarded
        # on this batch's completion count and recompile a compiled model every step.
        with head_input_replaced(head, completions_only):
            out = model(**inputs, **extra, use_cache=False)
        logits = out.logits[0]
    else:
        out = model(**inputs, **extra, use_cache=False)
        logits = out.logits[rows.to(out.logits.device), cols.to(out.logits.device)]
    logits = logits.to(accumulation_dtype(logits.dtype))
    picked = logits.gather(-1, picked_targets.to(logits.device)[:, None]).squeeze(-1)
    per_token = picked - torch.logsumexp(logits, dim=-1)
    aux = getattr(out, "aux_loss", None) if extra else None
    sums = torch.zeros(labels.size(0), dtype=per_token.dtype, device=per_token.device)
    device_rows = rows.to(per_token.device)
    if sequence_labels is None:
        return sums.index_add(0, device_rows, per_token), aux
    completion = (labels[:, 1:][rows, cols] != IGNORE_INDEX).to(per_token.device)  # a host mask, sent once
    in_completion = sums.index_add(0, device_rows, per_token * completion)
    return torch.stack([in_completion, sums.index_add(0, device_rows, per_token)]), aux


def nll_labels(batch: dict[str, torch.Tensor], settings: DPOSettings) -> torch.Tensor | None:
    """The host labels of the NLL term when it covers more than the completions: ORPO's, over the chosen rows'
    whole sequence (prompt and completion, as TRL's ORPOTrainer and the ORPO authors' code compute it), the
    rejected rows' completions unchanged. None otherwise (the NLL is over the chosen completions). Give it the host
    batch (the step does): from a device batch it reads the ids back (the evaluation does, once per eval batch)."""
    if settings.loss_type != "orpo":
        return None
    labels = batch["labels"].clone()
    b = labels.size(0) // 2
    ids, attention = batch["input_ids"][:b].to(labels.device), batch["attention_mask"][:b].to(labels.device)
    labels[:b] = ids.masked_fill(attention == 0, IGNORE_INDEX)
    return labels


def policy_logps(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], settings: DPOSettings, full: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The policy's summed completion log-probs ``[2B]``, the chosen rows' summed NLL (over ``full``'s positions
    when given, :func:`nll_labels`; else over the completions), and the router loss."""
    if full is None:
        sums, aux = completion_logps(model, _inputs(batch), batch["labels"], settings.loss)
        return sums, -sums[: sums.size(0) // 2].sum(), aux
    both, aux = completion_logps(model, _inputs(batch), batch["labels"], settings.loss, sequence_labels=full)
    return both[0], -both[1][: both.size(1) // 2].sum(), aux


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A collated micro-batch on ``device``, but for its labels: they stay on the host, where
    :func:`completion_logps` finds the completion positions without reading the device."""
    return {k: v if k == "labels" else v.to(device, non_blocking=True) for k, v in batch.items()}


# ---------------------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------------------


class Reference(Protocol):
    """Where a micro-batch's reference log-probs come from; every rank calls it on every micro-batch."""

    def logps(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[2B]`` reference completion log-probs of a micro-batch (:func:`to_device`), without gradient."""
        ...


def _inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


@contextmanager
def _evaluating(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode (no dropout) and no gradient inside; the mode is restored."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def _eval_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor], plan: LossPlan) -> torch.Tensor:
    """Completion log-probs in eval mode (no dropout), without gradient; the mode is restored."""
    with _evaluating(model):
        logps, _ = completion_logps(model, _inputs(batch), batch["labels"], plan)
    return logps


@dataclass
class FrozenModel:
    """A second, frozen model (FSDP2-sharded like the policy, no optimizer state) run without gradient."""

    model: torch.nn.Module
    plan: LossPlan

    def logps(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return _eval_logps(self.model, batch, self.plan)


@dataclass
class AdapterDisabled:
    """The LoRA policy with its adapter disabled: the base model it was loaded as, with no second copy."""

    model: torch.nn.Module
    plan: LossPlan

    def logps(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with self.model.disable_adapter():  # type: ignore[operator]
            return _eval_logps(self.model, batch, self.plan)


@dataclass
class Precomputed:
    """Reference log-probs looked up by pair index in a table computed before training (``[pairs, 2]``)."""

    table: torch.Tensor

    def logps(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        index = batch["pair_index"].to(self.table.device)
        rows = self.table[index]
        device = batch["input_ids"].device
        return torch.cat([rows[:, 0], rows[:, 1]]).to(device)


def even_batches(
    pairs: Sequence[Any], *, rank: int, world_size: int, batch_size: int, collator: Any
) -> Iterable[tuple[dict[str, torch.Tensor], bool]]:
    """This rank's batches of pairs ``rank, rank + world_size, ...``, the same number on every rank.

    Yields:
        ``(collated batch, real)``: after this rank's share, copies of its last batch with ``real=False``
        (run so that every rank takes part in every forward, their results unused).
    """
    n = len(pairs)
    if n == 0 or batch_size < 1:
        raise ValueError(f"needs pairs and batch_size >= 1 (got {n} pairs, batch_size={batch_size})")
    mine = list(range(rank, n, world_size))
    per_rank = math.ceil(math.ceil(n / world_size) / batch_size)
    last = None
    for b in range(per_rank):
        indices = mine[b * batch_size : (b + 1) * batch_size]
        if indices:
            last = collator([pairs[i] for i in indices])
            yield last, True
        else:
            yield (last if last is not None else collator([pairs[0]])), False


def _rank_batches(
    pairs: Sequence[Any], *, collator: Any, batch_size: int, device: torch.device
) -> Iterable[tuple[dict[str, torch.Tensor], bool]]:
    """This rank's :func:`even_batches` of ``pairs`` (the run's rank and world size), each :func:`to_device`."""
    for batch, real in even_batches(
        pairs,
        rank=collectives.rank(),
        world_size=collectives.world(),
        batch_size=batch_size,
        collator=collator,
    ):
        yield to_device(batch, device), real


def precompute_reference(
    reference: Reference, pairs: Sequence[Any], *, collator: Any, batch_size: int, device: torch.device
) -> Precomputed:
    """Every pair's reference log-probs in one pass, the pairs split over the ranks (every rank calls it).

    Returns:
        The table of every pair (``[pairs, 2]``: chosen, rejected; fp64), the same on every rank.
    """
    table = torch.zeros((len(pairs), 2), dtype=torch.float64, device=device)
    for on_device, real in _rank_batches(pairs, collator=collator, batch_size=batch_size, device=device):
        logps = reference.logps(on_device).double()
        if real:
            b = on_device["pair_index"].numel()
            table[on_device["pair_index"], 0] = logps[:b]
            table[on_device["pair_index"], 1] = logps[b:]
    return Precomputed(collectives.all_reduce_sum(table))


# ---------------------------------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------------------------------


@dataclass
class DPOStepOutput:
    """What a preference step did (tensors stay on the device until logged).

    Attributes:
        loss_sum: this rank's summed pair losses, plus (ORPO, SimPO with ``cpo_alpha``) its weighted chosen-token NLL
            scaled by ``pairs / chosen_tokens``, so that ``loss_sum / pairs`` summed over ranks is the step's loss.
        pairs: pairs of the step over every rank and micro-batch (the loss's denominator).
        sums: this rank's :data:`METRICS` sums, then the objective's extra metrics'.
        aux_sum: this rank's summed router loss (None without one).
        target_tokens: completion tokens of the step over every rank (the tokens that carry the loss).
        processed_tokens: tokens fed to the policy (padding included) over every rank.
        grad_norm: global gradient norm before clipping.
        lr: learning rate the step used.
        chosen_tokens: chosen completion tokens of the step over every rank (the NLL's denominator).
        extra_names: the objective's extra metrics (``nll_loss`` per chosen token, the others per pair).
    """

    loss_sum: torch.Tensor
    pairs: int
    sums: torch.Tensor
    aux_sum: torch.Tensor | None
    target_tokens: int
    processed_tokens: int
    grad_norm: torch.Tensor
    lr: float
    chosen_tokens: int = 0
    extra_names: tuple[str, ...] = field(default_factory=tuple)

    @property
    def loss_count(self) -> int:
        """What the summed loss is divided by: the step's pairs."""
        return self.pairs

    def extra_metrics(self, micro_batches: int) -> dict[str, float]:
        """Rewards, accuracy, margins and log-probs as means over the step's pairs, the objective's extras, and
        the router loss (collective: every rank calls it)."""
        values = [self.sums.double()]
        if self.aux_sum is not None:
            values.append(self.aux_sum.detach().double().reshape(1))
        total = collectives.all_reduce_sum(torch.cat(values))
        names = (*METRICS, *self.extra_names)
        out = {
            name: float(total[i]) / max(self.chosen_tokens if name == "nll_loss" else self.pairs, 1)
            for i, name in enumerate(names)
        }
        if self.aux_sum is not None:
            out["aux_loss"] = float(total[len(names)]) / (micro_batches * collectives.world())
        return out


def _nll_tokens(batch: dict[str, torch.Tensor], full: torch.Tensor | None) -> int:
    """The tokens the NLL term of a micro-batch averages over (host count): the chosen completions', or those of
    ``full`` (:func:`nll_labels`: ORPO's chosen sequences)."""
    labels = full if full is not None else batch["labels"]
    return int((labels[: batch["pair_index"].numel(), 1:] != IGNORE_INDEX).sum())


def dpo_forward_backward(
    model: torch.nn.Module,
    micro_batches: Sequence[dict[str, torch.Tensor]],
    reference: Reference | None,
    settings: DPOSettings,
    device: torch.device,
    guard: NonFiniteGuard | None = None,
) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor | None, int, int, int]:
    """Forward and backward of one preference step's micro-batches; gradients accumulate in the model.

    ``guard``: the previous step's non-finite flags are read with this step's counts, as in the SFT step.
    ``reference``: None for a reference-free objective (``settings.reference_free``).

    Returns:
        (summed loss as :class:`DPOStepOutput` defines it, global pairs, metric sums, summed router loss or None,
        global completion tokens, global processed tokens, global chosen completion tokens).
    """
    if (reference is None) is not settings.reference_free:
        raise ValueError(
            f"loss_type={settings.loss_type!r} " + ("takes no reference" if reference else "needs one")
        )
    fulls = [
        nll_labels(b, settings) for b in micro_batches
    ]  # from the host batches: no read back from the device
    local = torch.tensor(
        [
            sum(int(b["pair_index"].numel()) for b in micro_batches),
            sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in micro_batches),
            sum(b["input_ids"].numel() for b in micro_batches),
            sum(_nll_tokens(b, full) for b, full in zip(micro_batches, fulls, strict=True)),
        ],
        dtype=torch.long,
        device=device,
    )
    pairs, tokens, processed, chosen_tokens = read_step_counts(local, guard)  # the step's one host read
    scale = collectives.world() / pairs if pairs else 0.0
    nll_scale = settings.nll_weight * collectives.world() / chosen_tokens if chosen_tokens else 0.0
    router = RouterLoss(settings.loss.router_aux_coef, len(micro_batches), device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    sums = torch.zeros(len(METRICS) + len(settings.extra_metrics), dtype=torch.float64, device=device)
    for i, (batch, full) in enumerate(zip(micro_batches, fulls, strict=True)):
        choose_gradient_sync(model, i, len(micro_batches), settings.sync_each_microbatch)
        batch = to_device(batch, device)
        # First, without gradient: the same forwards on every rank (none when reference-free, on every rank).
        ref = reference.logps(batch) if reference is not None else None
        policy, nll, aux = policy_logps(model, batch, settings, full)
        lengths = batch["completion_mask"].sum(dim=1)
        losses, chosen, rejected, extras = pair_losses(policy, ref, lengths, settings)
        objective = losses.sum() * scale
        if nll_scale:
            objective = objective + nll * nll_scale
            loss_sum += nll.detach().double() * (settings.nll_weight * pairs / chosen_tokens)
        total = router.added(objective, aux)
        total.backward()
        loss_sum += losses.detach().double().sum()
        sums += metric_sums(policy, lengths, chosen, rejected, extras, settings, nll)
        del total, objective, policy, losses, nll
    return loss_sum, pairs, sums, router.sum, tokens, processed, chosen_tokens


def dpo_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    micro_batches: Sequence[dict[str, torch.Tensor]],
    reference: Reference | None,
    settings: DPOSettings,
    device: torch.device,
) -> DPOStepOutput:
    """One optimizer step of the preference objective over this rank's ``micro_batches`` (every rank calls it)."""
    loss_sum, pairs, sums, aux_sum, tokens, processed, chosen_tokens = dpo_forward_backward(
        model, micro_batches, reference, settings, device, guard_of(optimizer)
    )
    grad_norm, lr = clip_and_update(model, optimizer, scheduler, loss_sum, settings.max_grad_norm, pairs)
    return DPOStepOutput(
        loss_sum,
        pairs,
        sums,
        aux_sum,
        tokens,
        processed,
        grad_norm,
        lr,
        chosen_tokens,
        settings.extra_metrics,
    )


def evaluate_preferences(
    model: torch.nn.Module,
    reference: Reference | None,
    pairs: Sequence[Any],
    *,
    collator: Any,
    batch_size: int,
    settings: DPOSettings,
    device: torch.device,
) -> dict[str, float]:
    """The preference loss and metrics of every eval pair, each once (every rank calls it; the mode is restored).

    Returns:
        ``eval_loss``, ``eval_rewards/chosen`` ... (means over the eval pairs; ``eval_nll_loss`` over their chosen
        tokens) and ``eval_pairs``.
    """
    names = (*METRICS, *settings.extra_metrics)
    sums = torch.zeros(len(names) + 3, dtype=torch.float64, device=device)
    for on_device, real in _rank_batches(pairs, collator=collator, batch_size=batch_size, device=device):
        ref = reference.logps(on_device) if reference is not None else None
        full = nll_labels(on_device, settings)
        with _evaluating(model):
            policy, nll, _ = policy_logps(model, on_device, settings, full)
        lengths = on_device["completion_mask"].sum(dim=1)
        losses, chosen, rejected, extras = pair_losses(policy, ref, lengths, settings)
        if real:
            sums[0] += losses.double().sum()
            sums[1] += losses.numel()
            sums[2] += _nll_tokens(on_device, full)
            sums[3:] += metric_sums(policy, lengths, chosen, rejected, extras, settings, nll)
    total = collectives.all_reduce_sum(sums)
    n, chosen_tokens = max(float(total[1]), 1.0), max(float(total[2]), 1.0)
    values = {
        name: float(total[3 + i]) / (chosen_tokens if name == "nll_loss" else n)
        for i, name in enumerate(names)
    }
    out = {
        "eval_loss": float(total[0]) / n + settings.nll_weight * values.get("nll_loss", 0.0),
        "eval_pairs": int(total[1]),
    }
    out.update({f"eval_{name}": value for name, value in values.items()})
    return out
