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
from hf_fsdp2.train.loss import LossPlan
from hf_fsdp2.train.nonfinite import guard_of
from hf_fsdp2.train.reference import evaluating, rank_batches, row_inputs, to_device
from hf_fsdp2.train.step import RouterLoss, choose_gradient_sync, clip_and_update, read_step_counts

# Summed per pair (accuracy, margin) or per row (the reward's first two moments).
SUMS = ("accuracy", "margin", "reward_sum", "reward_sq")


@dataclass(frozen=True)
class RewardSettings:
    """How a reward-model step runs.

    Attributes:
        loss: the run's loss plan (the router loss of a MoE model; no LM head).
        center_rewards_coefficient: weight of the centering term (TRL's name; 0 = none).
        max_grad_norm: clip the global gradient norm (0 = measured only).
        sync_each_microbatch: reduce-scatter after every micro-batch, or only after the last.
    """

    loss: LossPlan
    center_rewards_coefficient: float = 0.0
    max_grad_norm: float = 1.0
    sync_each_microbatch: bool = True


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
    return {"accuracy": float(total[0]) / max(pairs, 1), "margin": float(total[1]) / max(pairs, 1),
            "mean_reward": mean, "std_reward": math.sqrt(variance), "min_reward": low, "max_reward": high}  # fmt: skip


@dataclass
class RewardStepOutput:
    """What a reward step did (tensors stay on the device until logged).

    Attributes:
        loss_sum: this rank's summed pair losses (``loss_sum / pairs`` summed over ranks is the step's loss).
        pairs: pairs of the step over every rank and micro-batch.
        sums: this rank's :data:`SUMS`.
        high / low: this rank's largest and smallest reward of the step.
        aux_sum: this rank's summed router loss (None without one).
        target_tokens / processed_tokens: tokens of the rows (padding excluded / included), over every rank.
        grad_norm: global gradient norm before clipping.
        lr: learning rate the step used.
    """

    loss_sum: torch.Tensor
    pairs: int
    sums: torch.Tensor
    high: torch.Tensor
    low: torch.Tensor
    aux_sum: torch.Tensor | None
    target_tokens: int
    processed_tokens: int
    grad_norm: torch.Tensor
    lr: float

    @property
    def loss_count(self) -> int:
        return self.pairs

    def extra_metrics(self, micro_batches: int) -> dict[str, float]:
        """Accuracy, margin and the rewards' mean, std, min and max over the step (collective: every rank calls)."""
        values = [self.sums.double()]
        if self.aux_sum is not None:
            values.append(self.aux_sum.detach().double().reshape(1))
        total = collectives.all_reduce_sum(torch.cat(values))
        high, neg_low = collectives.all_reduce_max([float(self.high), -float(self.low)])
        out = _metrics(total, self.pairs, high, -neg_low)
        if self.aux_sum is not None:
            out["aux_loss"] = float(total[len(SUMS)]) / (micro_batches * collectives.world())
        return out


def reward_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    micro_batches: Sequence[dict[str, torch.Tensor]],
    settings: RewardSettings,
    device: torch.device,
) -> RewardStepOutput:
    """One optimizer step of the reward model over this rank's ``micro_batches`` (every rank calls it)."""
    local = torch.tensor(
        [
            sum(int(b["pair_index"].numel()) for b in micro_batches),
            sum(int(b["attention_mask"].sum()) for b in micro_batches),
            sum(b["input_ids"].numel() for b in micro_batches),
        ],
        dtype=torch.long,
        device=device,
    )
    pairs, tokens, processed = read_step_counts(local, guard_of(optimizer))  # the step's one host read
    scale = collectives.world() / pairs if pairs else 0.0
    router = RouterLoss(settings.loss.router_aux_coef, len(micro_batches), device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    sums = torch.zeros(len(SUMS), dtype=torch.float64, device=device)
    high = torch.full((), -math.inf, dtype=torch.float64, device=device)
    low = torch.full((), math.inf, dtype=torch.float64, device=device)
    for i, batch in enumerate(micro_batches):
        choose_gradient_sync(model, i, len(micro_batches), settings.sync_each_microbatch)
        batch = to_device(batch, device)
        rewards, aux = rewards_of(model, batch)
        losses = bt_losses(rewards, batch.get("margin"), settings)
        total = router.added(losses.sum() * scale, aux)
        total.backward()
        loss_sum += losses.detach().double().sum()
        values, top, bottom = _sums(rewards)
        sums += values
        high, low = torch.maximum(high, top), torch.minimum(low, bottom)
        del total, losses, rewards
    grad_norm, lr = clip_and_update(model, optimizer, scheduler, loss_sum, settings.max_grad_norm, pairs)
    return RewardStepOutput(loss_sum, pairs, sums, high, low, router.sum, tokens, processed, grad_norm, lr)


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
