"""GRPO's arithmetic: group-normalised advantages and the clipped surrogate loss (``grpo``, ``dr_grpo``, ``dapo``),
with an optional KL penalty to a reference, as TRL 1.16's ``GRPOTrainer`` defines them.

For each prompt the rollout samples ``num_generations`` completions; a completion's reward is the weighted sum of the
reward functions' values, its advantage that reward minus its group's mean reward, divided by the group's standard
deviation (``scale_rewards: group``), the whole batch's (``batch``), or not at all (``none``), plus 1e-4.

Per completion token t, with ratio ``r = exp(logp - old_logp)`` (old: the policy that sampled; equal to the current
one on the first iteration over a generation batch):

    loss_t = -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) + beta * r * (exp(ref - logp) - (ref - logp) - 1)

(the factor r on the KL term: ``use_bias_correction_kl``, TRL's default, the unbiased reverse-KL gradient of
DeepSeek-V3.2; without it the k3 estimator alone)

and the loss of a batch, over its completion tokens (mask):

- ``grpo``: each completion's mean over its tokens, then the mean over completions;
- ``dr_grpo``: the sum over every token divided by (completions x ``max_completion_length``);
- ``dapo``: the sum over every token divided by the number of tokens.

:func:`grpo_loss_sums` returns the numerator and the count (completions, or tokens for ``dapo``) of one micro-batch,
so the step divides by the global count over every micro-batch of every rank, as the other recipes' steps do:
the step's loss is then the same whatever the split across micro-batches and ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hf_fsdp2.methods.grpo.config import GRPO_LOSS_TYPES

SCALE_REWARDS = ("group", "batch", "none")
STD_EPSILON = 1e-4  # added to the standard deviation, as TRL


@dataclass(frozen=True)
class GrpoSettings:
    """The loss's settings (TRL's ``GRPOConfig`` names)."""

    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: epsilon
    beta: float = 0.0
    max_completion_length: int = 256
    num_generations: int = 8
    scale_rewards: str = "group"
    use_bias_correction_kl: bool = True  # the KL term times the ratio (TRL's default, DeepSeek-V3.2)

    def __post_init__(self) -> None:
        if self.loss_type not in GRPO_LOSS_TYPES:
            raise ValueError(f"loss_type={self.loss_type!r} is not one of {GRPO_LOSS_TYPES}")
        if self.scale_rewards not in SCALE_REWARDS:
            raise ValueError(f"scale_rewards={self.scale_rewards!r} is not one of {SCALE_REWARDS}")
        if self.num_generations < 2:
            raise ValueError(
                f"num_generations={self.num_generations} must be >= 2: a group of one has no baseline"
            )

    @property
    def high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Bessel-corrected standard deviation over the non-NaN values (NaN for fewer than 2), as TRL's ``nanstd``."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(values)).sum(dim=dim, keepdim=True)
    variance = variance * torch.where(
        count > 1, count / (count - 1).clamp(min=1), torch.full_like(variance, math.nan)
    )
    std = variance.sqrt()
    return std.squeeze() if dim is None else std.squeeze(dim)


def group_advantages(
    rewards: torch.Tensor, settings: GrpoSettings, batch_std: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages of ``rewards`` (completions of one prompt consecutive, ``num_generations`` each) and, per
    completion, whether its scaling standard deviation is zero (no learning signal; TRL logs their fraction).

    A NaN reward (no reward function scored the completion) stays out of its group's mean and deviation and gets
    advantage 0, as does every completion of a group with no scored one (TRL's rule). ``batch_std``: the standard
    deviation over the whole generation batch (every rank's), for ``scale_rewards: batch``; the local one if None.
    """
    n = settings.num_generations
    grouped = rewards.view(-1, n)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(n)
    if settings.scale_rewards == "batch":
        std = (nanstd(rewards) if batch_std is None else batch_std).expand_as(rewards)
    else:
        std = nanstd(grouped, dim=1).repeat_interleave(n)
    advantages = rewards - mean
    if settings.scale_rewards != "none":
        advantages = advantages / (std + STD_EPSILON)
    return torch.nan_to_num(advantages, nan=0.0), torch.isclose(std, torch.zeros_like(std))


@dataclass
class LossSums:
    """One micro-batch's loss numerator and count, and the sums of its logged statistics (over completion tokens)."""

    loss: torch.Tensor  # differentiable
    count: torch.Tensor  # completions (grpo, dr_grpo) or completion tokens (dapo)
    tokens: torch.Tensor
    kl: torch.Tensor
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor


def per_token_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    settings: GrpoSettings,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loss of every completion token [B, T], its KL term (zeros without a reference) and the ratio."""
    old = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - settings.epsilon, 1 + settings.high)
    adv = advantages.unsqueeze(1)
    loss = -torch.min(ratio * adv, clipped * adv)
    kl = torch.zeros_like(logps)
    if settings.beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs the reference's log-probs")
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        # The unbiased reverse-KL gradient (TRL's use_bias_correction_kl); differentiable through the ratio.
        if settings.use_bias_correction_kl:
            kl = kl * ratio
        loss = loss + settings.beta * kl
    return loss, kl, ratio


def grpo_loss_sums(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: GrpoSettings,
) -> LossSums:
    """The micro-batch's loss numerator and count for ``settings.loss_type`` (module docstring); the step's loss is
    the sum of the numerators over the step divided by the sum of the counts."""
    loss, kl, ratio = per_token_loss(logps, old_logps, ref_logps, advantages, settings)
    mask = mask.to(loss.dtype)
    lengths = mask.sum(-1)
    completions = torch.tensor(float(mask.shape[0]), dtype=loss.dtype, device=loss.device)
    if settings.loss_type == "grpo":
        numerator, count = ((loss * mask).sum(-1) / lengths.clamp(min=1.0)).sum(), completions
    elif settings.loss_type == "dr_grpo":
        numerator, count = (loss * mask).sum() / settings.max_completion_length, completions
    else:  # dapo
        numerator, count = (loss * mask).sum(), lengths.sum()
    adv = advantages.unsqueeze(1)
    low = ((ratio < 1 - settings.epsilon) & (adv < 0)).to(loss.dtype)
    high = ((ratio > 1 + settings.high) & (adv > 0)).to(loss.dtype)
    return LossSums(
        loss=numerator,
        count=count.detach(),
        tokens=lengths.sum().detach(),
        kl=(kl * mask).sum().detach(),
        clipped_low=(low * mask).sum().detach(),
        clipped_high=(high * mask).sum().detach(),
    )


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: GrpoSettings,
) -> torch.Tensor:
    """The loss of one whole batch (one micro-batch, one process): numerator over count."""
    sums = grpo_loss_sums(logps, old_logps, ref_logps, advantages, mask, settings)
    return sums.loss / sums.count.clamp(min=1.0)


def completion_token_logps(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_length: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probs [B, T] of the last ``completion_length`` tokens of each row under ``model``, from logits divided by
    the sampling ``temperature`` (the distribution the completions were sampled from, as TRL scores them)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -completion_length - 1 : -1]
    logps = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logps.gather(-1, input_ids[:, -completion_length:].unsqueeze(-1)).squeeze(-1)
