"""The preference step (DPO and its variants, SimPO, ORPO) and its evaluation. The log-probs and references are
:mod:`hf_fsdp2.train.reference` (none for the reference-free objectives); the formulas :mod:`hf_fsdp2.methods.dpo.loss`.

A micro-batch holds B pairs as 2B rows, chosen rows then rejected rows (:class:`~hf_fsdp2.data.pairs.
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

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_fsdp2 import collectives
from hf_fsdp2.labels import IGNORE_INDEX
from hf_fsdp2.methods.dpo.loss import METRICS, DPOSettings, metric_sums, pair_losses
from hf_fsdp2.train.nonfinite import NonFiniteGuard, guard_of
from hf_fsdp2.train.reference import (
    Reference,
    completion_logps,
    counts_here,
    evaluating,
    rank_batches,
    row_inputs,
    to_device,
)
from hf_fsdp2.train.step import RouterLoss, choose_gradient_sync, clip_and_update, read_step_counts


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
        sums, aux = completion_logps(model, row_inputs(batch), batch["labels"], settings.loss)
        return sums, -sums[: sums.size(0) // 2].sum(), aux
    both, aux = completion_logps(
        model, row_inputs(batch), batch["labels"], settings.loss, sequence_labels=full
    )
    return both[0], -both[1][: both.size(1) // 2].sum(), aux


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
    here = counts_here()  # under context parallel, one rank per cp group counts the group's pairs
    local = torch.tensor(
        [
            sum(int(b["pair_index"].numel()) for b in micro_batches),
            sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in micro_batches),
            sum(b["input_ids"].numel() for b in micro_batches),
            sum(_nll_tokens(b, full) for b, full in zip(micro_batches, fulls, strict=True)),
        ]
        if here
        else [0, 0, 0, 0],
        dtype=torch.long,
        device=device,
    )
    pairs, tokens, processed, chosen_tokens = read_step_counts(local, guard)  # the step's one host read
    # FSDP2 averages over every rank. Under context parallel each rank of a group computes the group's whole loss
    # from the all-reduced sums, whose backward adds the cp ranks' equal output gradients: cp x each part's share;
    # dividing by cp leaves the gradient of the mean over the step's pairs (tests/distributed: equal to cp 1).
    world = collectives.world() / collectives.cp_size()
    scale = world / pairs if pairs else 0.0
    nll_scale = settings.nll_weight * world / chosen_tokens if chosen_tokens else 0.0
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
            if here:
                loss_sum += nll.detach().double() * (settings.nll_weight * pairs / chosen_tokens)
        total = router.added(objective, aux)
        total.backward()
        if here:
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
    for on_device, real in rank_batches(pairs, collator=collator, batch_size=batch_size, device=device):
        ref = reference.logps(on_device) if reference is not None else None
        full = nll_labels(on_device, settings)
        with evaluating(model):
            policy, nll, _ = policy_logps(model, on_device, settings, full)
        lengths = on_device["completion_mask"].sum(dim=1)
        losses, chosen, rejected, extras = pair_losses(policy, ref, lengths, settings)
        if real and counts_here():
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
