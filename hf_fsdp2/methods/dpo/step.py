"""The preference step (DPO and its variants, SimPO, ORPO) and its evaluation. The log-probs and references are
:mod:`hf_fsdp2.train.logps` (none for the reference-free objectives); the formulas :mod:`hf_fsdp2.methods.dpo.loss`.

A micro-batch holds B pairs as 2B rows, chosen rows then rejected rows (:class:`~hf_fsdp2.data.pairs.
PreferenceCollator`), and goes through the policy in one forward. A row's log-prob is the SUM of the log-probs of
its completion tokens (TRL's definition).

The step is the shared skeleton (:func:`hf_fsdp2.train.step.train_step`) with :class:`DPOLoss`: the loss is the
mean over every pair of every micro-batch of every rank (each micro-batch's summed pair losses over the step's global
pairs); an objective with an NLL term (ORPO, SimPO with ``cpo_alpha``) adds the chosen rows' summed NLL (SimPO: their
completions; ORPO: prompt and completion, :func:`nll_labels`) over the step's global NLL tokens. Every rank runs the
same forwards whatever its data: the reference forward (or table lookup; none when reference-free, for every rank
alike: the objective is the run's) and the policy forward of each micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hf_fsdp2 import collectives
from hf_fsdp2.labels import IGNORE_INDEX
from hf_fsdp2.methods.dpo.loss import METRICS, DPOSettings, metric_sums, pair_losses
from hf_fsdp2.train.logps import (
    Reference,
    completion_logps,
    counts_here,
    evaluating,
    rank_batches,
    row_inputs,
    to_device,
)
from hf_fsdp2.train.loss import LossPlan
from hf_fsdp2.train.nonfinite import NonFiniteGuard
from hf_fsdp2.train.step import Batch, LossTerm, MicroLoss, StepCounts, StepLoss


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
    model: torch.nn.Module, batch: dict[str, torch.Tensor], plan: LossPlan, full: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The policy's summed completion log-probs ``[2B]``, the chosen rows' summed NLL (over ``full``'s positions
    when given, :func:`nll_labels`; else over the completions), and the router loss."""
    if full is None:
        sums, aux = completion_logps(model, row_inputs(batch), batch["labels"], plan)
        return sums, -sums[: sums.size(0) // 2].sum(), aux
    both, aux = completion_logps(model, row_inputs(batch), batch["labels"], plan, sequence_labels=full)
    return both[0], -both[1][: both.size(1) // 2].sum(), aux


def _nll_tokens(batch: dict[str, torch.Tensor], full: torch.Tensor | None) -> int:
    """The tokens the NLL term of a micro-batch averages over (host count): the chosen completions', or those of
    ``full`` (:func:`nll_labels`: ORPO's chosen sequences)."""
    labels = full if full is not None else batch["labels"]
    return int((labels[: batch["pair_index"].numel(), 1:] != IGNORE_INDEX).sum())


class DPOLoss(StepLoss):
    """One preference step's loss (:class:`~hf_fsdp2.train.step.StepLoss`): per micro-batch, the summed pair losses
    over the step's global pairs, plus (ORPO, SimPO with ``cpo_alpha``) the chosen rows' summed NLL over the step's
    global NLL tokens, weighted by ``nll_weight``.

    Under context parallel every rank of a cp group computes the group's whole loss from the all-reduced log-prob
    sums, whose backward adds the cp ranks' equal output gradients: each term carries ``1 / cp_size``, which leaves
    the gradient of the mean over the step's pairs (tests/distributed: equal to cp 1). One rank per cp group counts
    the pairs and logs the sums (:func:`counts_here`).

    The logged loss sum (fp64) is the summed pair losses plus the NLL scaled by ``pairs / chosen_tokens``, so that
    ``loss_sum / pairs`` summed over ranks is the step's loss.
    """

    log_dtype = torch.float64

    def __init__(
        self, reference: Reference | None, settings: DPOSettings, plan: LossPlan, device: torch.device
    ) -> None:
        if (reference is None) is not settings.reference_free:
            raise ValueError(
                f"loss_type={settings.loss_type!r} " + ("takes no reference" if reference else "needs one")
            )
        self.reference, self.settings, self.plan, self.device = reference, settings, plan, device
        self.here = counts_here()  # under context parallel, one rank per cp group counts the group's pairs
        self.sums = torch.zeros(
            len(METRICS) + len(settings.extra_metrics), dtype=torch.float64, device=device
        )
        self.fulls: list[torch.Tensor | None] = []
        self.pairs = self.chosen_tokens = 0

    def prepare(self, micro_batches: Sequence[Batch]) -> Sequence[Batch]:
        # From the host batches: no read back from the device.
        self.fulls = [nll_labels(b, self.settings) for b in micro_batches]
        return micro_batches

    def local_counts(self, micro_batches: Sequence[Batch]) -> list[int]:
        if not self.here:
            return [0, 0, 0, 0]
        return [
            sum(int(b["pair_index"].numel()) for b in micro_batches),
            sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in micro_batches),
            sum(b["input_ids"].numel() for b in micro_batches),
            sum(_nll_tokens(b, full) for b, full in zip(micro_batches, self.fulls, strict=True)),
        ]

    def begin(self, counts: Sequence[int], guard: NonFiniteGuard | None) -> StepCounts:
        pairs, tokens, processed, chosen_tokens = counts
        self.pairs, self.chosen_tokens = pairs, chosen_tokens
        return StepCounts(
            loss_count=pairs, loss_units=pairs, target_tokens=tokens, processed_tokens=processed
        )

    def micro(self, model: torch.nn.Module, batch: Batch, index: int) -> MicroLoss:
        s, full = self.settings, self.fulls[index]
        batch = to_device(batch, self.device)
        # First, without gradient: the same forwards on every rank (none when reference-free, on every rank).
        ref = self.reference.logps(batch) if self.reference is not None else None
        policy, nll, aux = policy_logps(model, batch, self.plan, full)
        lengths = batch["completion_mask"].sum(dim=1)
        losses, chosen, rejected, extras = pair_losses(policy, ref, lengths, s)
        share = 1 / collectives.cp_size()
        terms = [LossTerm(losses.sum(), self.pairs, share)]
        logged: list[torch.Tensor] = []
        if s.nll_weight and self.chosen_tokens:
            terms.append(LossTerm(nll, self.chosen_tokens, s.nll_weight * share))
            if self.here:
                logged.append(nll.detach().double() * (s.nll_weight * self.pairs / self.chosen_tokens))
        if self.here:
            logged.append(losses.detach().double().sum())
            self.sums += metric_sums(policy, lengths, chosen, rejected, extras, s, nll)
        return MicroLoss(tuple(terms), tuple(logged), aux)

    def metrics(self, micro_batches: int) -> dict[str, float]:
        """Rewards, accuracy, margins and log-probs as means over the step's pairs, and the objective's extras
        (``nll_loss`` per chosen token); collective: every rank calls it."""
        total = collectives.all_reduce_sum(self.sums.double())
        names = (*METRICS, *self.settings.extra_metrics)
        return {
            name: float(total[i]) / max(self.chosen_tokens if name == "nll_loss" else self.pairs, 1)
            for i, name in enumerate(names)
        }


def evaluate_preferences(
    model: torch.nn.Module,
    reference: Reference | None,
    pairs: Sequence[Any],
    *,
    collator: Any,
    batch_size: int,
    settings: DPOSettings,
    plan: LossPlan,
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
            policy, nll, _ = policy_logps(model, on_device, plan, full)
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
