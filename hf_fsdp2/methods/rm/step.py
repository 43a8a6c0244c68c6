"""Reward modelling: the Bradley-Terry step and evaluation of a model with a scalar score head, as TRL 1.16's
``RewardTrainer`` computes them.

A micro-batch holds B pairs as 2B rows, chosen rows then rejected rows (:class:`~hf_fsdp2.data.pairs.
PreferenceCollator`, each row the whole prompt + completion); the model (``AutoModelForSequenceClassification``, one
label) gives each row's reward at its last non-padding token. Per pair, with ``r_c`` and ``r_r`` the rewards and
``m`` the record's ``margin`` (0 without one):

    ``−logσ(r_c − r_r − m) + center_rewards_coefficient · (r_c + r_r)²``

(the centering term as TRL adds it, mean of the squared sums). The step's loss is the mean over every pair of every
micro-batch of every rank (TRL: the mean per micro-batch, then over the accumulation steps: the same with equal
micro-batches). Logged as TRL names them: ``accuracy`` (``r_c > r_r``), ``margin`` (``r_c − r_r``), ``mean_reward``,
``min_reward``, ``max_reward``, plus ``std_reward`` (over the step's rewards). Every rank runs the same forward per
micro-batch whatever its data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hf_fsdp2 import collectives
from hf_fsdp2.train.logps import evaluating, rank_batches, row_inputs, to_device
from hf_fsdp2.train.nonfinite import NonFiniteGuard
from hf_fsdp2.train.step import Batch, LossTerm, MicroLoss, StepCounts, StepLoss

# Summed per pair (accuracy, margin) or per row (the reward's first two moments).
SUMS = ("accuracy", "margin", "reward_sum", "reward_sq")


@dataclass(frozen=True)
class RewardSettings:
    """The reward objective's constants (how the step runs is :class:`~hf_fsdp2.train.step.StepSettings`).

    Attributes:
        center_rewards_coefficient: weight of the centering term (TRL's name; 0 = none).
    """

    center_rewards_coefficient: float = 0.0


def rewards_of(
    model: torch.nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's reward (fp32: ``[2B]``) and the router loss (or None)."""
    out = model(**row_inputs(batch), use_cache=False)
    return out.logits.squeeze(-1).float(), getattr(out, "aux_loss", None)


def bt_losses(rewards: torch.Tensor, margin: torch.Tensor | None, settings: RewardSettings) -> torch.Tensor:
    """Per pair, the Bradley-Terry loss (with the margin) and the centering term (``[B]``)."""
    b = rewards.size(0) // 2
    chosen, rejected = rewards[:b], rewards[b:]
    delta = chosen - rejected - (margin.to(rewards) if margin is not None else 0)
    losses = -F.logsigmoid(delta)
    if settings.center_rewards_coefficient:
        losses = losses + settings.center_rewards_coefficient * (chosen + rejected) ** 2
    return losses


def _sums(rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:data:`SUMS` of a micro-batch (fp64), and its largest and smallest reward."""
    r = rewards.detach().double()
    b = r.size(0) // 2
    values = torch.stack([(r[:b] > r[b:]).double().sum(), (r[:b] - r[b:]).sum(), r.sum(), (r * r).sum()])
    return values, r.max(), r.min()


def _metrics(total: torch.Tensor, pairs: int, high: float, low: float) -> dict[str, float]:
    rows = max(2 * pairs, 1)
    mean = float(total[2]) / rows
    variance = max(float(total[3]) / rows - mean * mean, 0.0) * rows / max(rows - 1, 1)
    return {
        "accuracy": float(total[0]) / max(pairs, 1),
        "margin": float(total[1]) / max(pairs, 1),
        "mean_reward": mean,
        "std_reward": math.sqrt(variance),
        "min_reward": low,
        "max_reward": high,
    }


class RewardLoss(StepLoss):
    """One reward-model step's loss (:class:`~hf_fsdp2.train.step.StepLoss`): per micro-batch, the summed pair losses
    over the step's global pairs; the step's accuracy, margin and reward moments kept for its metrics."""

    log_dtype = torch.float64

    def __init__(self, settings: RewardSettings, device: torch.device) -> None:
        self.settings, self.device = settings, device
        self.sums = torch.zeros(len(SUMS), dtype=torch.float64, device=device)
        self.high = torch.full((), -math.inf, dtype=torch.float64, device=device)
        self.low = torch.full((), math.inf, dtype=torch.float64, device=device)
        self.pairs = 0

    def local_counts(self, micro_batches: Sequence[Batch]) -> list[int]:
        return [
            sum(int(b["pair_index"].numel()) for b in micro_batches),
            sum(int(b["attention_mask"].sum()) for b in micro_batches),
            sum(b["input_ids"].numel() for b in micro_batches),
        ]

    def begin(self, counts: Sequence[int], guard: NonFiniteGuard | None) -> StepCounts:
        pairs, tokens, processed = counts
        self.pairs = pairs
        return StepCounts(
            loss_count=pairs, loss_units=pairs, target_tokens=tokens, processed_tokens=processed
        )

    def micro(self, model: torch.nn.Module, batch: Batch, index: int) -> MicroLoss:
        batch = to_device(batch, self.device)
        rewards, aux = rewards_of(model, batch)
        losses = bt_losses(rewards, batch.get("margin"), self.settings)
        values, top, bottom = _sums(rewards)
        self.sums += values
        self.high, self.low = torch.maximum(self.high, top), torch.minimum(self.low, bottom)
        return MicroLoss((LossTerm(losses.sum(), self.pairs),), (losses.detach().double().sum(),), aux)

    def metrics(self, micro_batches: int) -> dict[str, float]:
        """Accuracy, margin and the rewards' mean, std, min and max over the step (collective: every rank calls)."""
        total = collectives.all_reduce_sum(self.sums.double())
        high, neg_low = collectives.all_reduce_max([float(self.high), -float(self.low)])
        return _metrics(total, self.pairs, high, -neg_low)


def evaluate_rewards(
    model: torch.nn.Module,
    pairs: Sequence[Any],
    *,
    collator: Any,
    batch_size: int,
    settings: RewardSettings,
    device: torch.device,
) -> dict[str, float]:
    """The loss, accuracy, margin and reward statistics of every eval pair, each once (every rank calls it; the mode
    is restored).

    Returns:
        ``eval_loss``, ``eval_accuracy``, ``eval_margin``, ``eval_mean_reward`` ... and ``eval_pairs``.
    """
    sums = torch.zeros(len(SUMS) + 2, dtype=torch.float64, device=device)  # + loss, pairs
    high, low = -math.inf, math.inf
    for on_device, real in rank_batches(pairs, collator=collator, batch_size=batch_size, device=device):
        with evaluating(model):
            rewards, _ = rewards_of(model, on_device)
        if real:
            losses = bt_losses(rewards, on_device.get("margin"), settings)
            values, top, bottom = _sums(rewards)
            sums[: len(SUMS)] += values
            sums[-2] += losses.double().sum()
            sums[-1] += losses.numel()
            high, low = max(high, float(top)), min(low, float(bottom))
    total = collectives.all_reduce_sum(sums)
    high, neg_low = collectives.all_reduce_max([high, -low])
    n = int(total[-1])
    out = {"eval_loss": float(total[-2]) / max(n, 1), "eval_pairs": n}
    out.update({f"eval_{k}": v for k, v in _metrics(total, n, high, -neg_low).items()})
    return out
