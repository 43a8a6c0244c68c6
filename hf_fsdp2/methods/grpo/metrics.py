"""What a GRPO generation batch holds (:class:`Rollout`) and what a step reports beyond the shared
:class:`~hf_fsdp2.train.step.StepOutput`: :class:`GrpoStepMetrics` (TRL's metric names), the counts a step without a
learning signal is decided and named from, and the ``log_completions`` table."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_fsdp2 import collectives
from hf_fsdp2.methods.grpo.rewards import RewardFunction, reward_metrics

STATS = ("kl", "clipped_low", "clipped_high", "clip_count", "tokens", "entropy")
"""The per-step statistics a step sums over its micro-batches (this rank's) before they are logged."""


@dataclass(kw_only=True)
class Rollout:
    """A generation batch on this rank: ``rows`` (prompt left-padded + completion right-padded) per micro-batch,
    and this rank's share of the rewards, advantages and texts."""

    rows: list[dict[str, torch.Tensor]]
    rewards: torch.Tensor  # [completions]
    per_function: torch.Tensor  # [completions, functions]
    advantages: torch.Tensor
    zero_std: torch.Tensor
    lengths: list[int]
    completions: list[str]
    prompts: list[Any]
    clipped: int = 0  # completions that reached max_completion_length without an end token
    signal: list[int] = field(
        default_factory=list
    )  # signal_counts of the whole generation batch (every rank's)
    loss_tokens: int = 0  # completion tokens in the loss over every rank (dapo's normaliser)
    old: list[torch.Tensor] | None = None  # the sampler's log-probs per micro-batch
    refs: list[torch.Tensor] | None = None  # the reference's
    step: int = 0  # the step that sampled it
    sampling: dict[str, float] = field(
        default_factory=dict
    )  # vLLM's importance sampling metrics (vllm/importance.py)


@dataclass(kw_only=True)
class GrpoStepMetrics:
    """A GRPO step's metrics under TRL's names (``metrics(micro_batches)``, collective; the statistics are this
    rank's sums until logged)."""

    stats: torch.Tensor  # STATS, this rank's sums over the step's micro-batches
    roll: Rollout  # the generation batch the step's last micro-batch came from
    function_names: list[str]
    beta: float
    device: torch.device
    functions: Sequence[RewardFunction] = ()  # their log_metric values are logged
    table: list[dict[str, Any]] | None = None  # log_completions (rank 0): the rows since the last logged step
    table_limit: int | None = None  # num_completions_to_print
    table_sink: Callable[[list[dict[str, Any]]], None] | None = None  # the trackers' table (objective)
    timing: Callable[[torch.device], dict[str, float]] | None = None  # rollout/* (timing.py)

    def __call__(self, micro_batches: int) -> dict[str, float]:
        """TRL's names: reward, reward_std, rewards/<fn>/mean|std, completions/*, clip_ratio/*, kl, frac_reward_zero_std
        (collective: every rank calls it)."""
        r, table = self.roll.rewards.double(), self.roll.per_function.double()
        valid = ~torch.isnan(r)
        parts = [
            self.stats.double().cpu(),
            torch.stack(
                [
                    valid.sum().double(),
                    r.nan_to_num().sum(),
                    (r.nan_to_num() ** 2).sum(),
                    self.roll.zero_std.double().sum(),
                    torch.tensor(float(r.numel())),
                ]
            ),
        ]
        for i in range(table.shape[1]):
            col = table[:, i]
            ok = ~torch.isnan(col)
            parts.append(
                torch.stack([ok.sum().double(), col.nan_to_num().sum(), (col.nan_to_num() ** 2).sum()])
            )
        lengths = torch.tensor(self.roll.lengths, dtype=torch.float64)
        parts.append(
            torch.tensor(
                [float(lengths.sum()), float(len(lengths)), float(self.roll.clipped)], dtype=torch.float64
            )
        )
        total = collectives.all_reduce_sum(torch.cat(parts).to(self.device)).cpu()
        lows = collectives.all_reduce_max([-float(lengths.min()), float(lengths.max())])
        kl, low, high, clip_count, tokens, entropy = total[: len(STATS)].tolist()
        n, s, ss, zero, completions = total[len(STATS) : len(STATS) + 5].tolist()

        def std(count: float, total_: float, squares: float) -> float:
            return (
                math.sqrt(max(squares - total_ * total_ / count, 0.0) / (count - 1))
                if count > 1
                else math.nan
            )

        out = {
            "reward": s / n if n else math.nan,
            "reward_std": std(n, s, ss),
            "frac_reward_zero_std": zero / completions,
            "clip_ratio/low_mean": low / max(clip_count, 1),
            "clip_ratio/high_mean": high / max(clip_count, 1),
            "clip_ratio/region_mean": (low + high) / max(clip_count, 1),
            "entropy": entropy / max(tokens, 1),
        }
        if self.beta:
            out["kl"] = kl / max(tokens, 1)
        at = len(STATS) + 5
        for name in self.function_names:
            c, fs, fss = total[at : at + 3].tolist()
            out[f"rewards/{name}/mean"], out[f"rewards/{name}/std"] = (
                (fs / c if c else math.nan),
                std(c, fs, fss),
            )
            at += 3
        length_sum, length_n, clipped = total[at : at + 3].tolist()
        out["completions/mean_length"] = length_sum / max(length_n, 1)
        out["completions/clipped_ratio"] = clipped / max(length_n, 1)
        out["completions/min_length"], out["completions/max_length"] = -float(lows[0]), float(lows[1])
        out.update(
            reward_metrics(self.functions, self.device)
        )  # every rank: the functions' log_metric values
        out.update(self.roll.sampling)
        if self.timing is not None:  # every rank: the rollout's seconds and tokens since the last log
            out.update(self.timing(self.device))
        if (
            self.table is not None
        ):  # rank 0, with log_completions: written to metrics.jsonl (trackers: objective)
            rows = list(self.table if self.table_limit is None else self.table[: self.table_limit])
            self.table.clear()  # the stepper's list: the next logged step has the rows sampled after this one
            out["completions"] = rows  # type: ignore[assignment]
            if rows and self.table_sink is not None:
                self.table_sink(rows)
        return out


def signal_counts(roll: Rollout) -> list[int]:
    """This rank's counts a step without a learning signal is decided and named from (summed over the ranks):
    completions with a non-zero advantage, completions, completions with a reward, and per reward function the
    completions it scored (did not return None for)."""
    scored = (~torch.isnan(roll.per_function)).sum(dim=0).tolist() if roll.per_function.numel() else []
    return [
        int((roll.advantages != 0).sum()),
        int(roll.rewards.numel()),
        int((~torch.isnan(roll.rewards)).sum()),
        *(int(n) for n in scored),
    ]


def no_signal_message(counts: Sequence[int], names: Sequence[str], generations: int, step: int) -> str:
    """What a step without a learning signal had (``counts``: :func:`signal_counts` summed over the ranks), the
    reward functions named."""
    _, completions, rewarded, *scored = counts
    per_function = ", ".join(
        f"{name!r} scored {n} of {completions}" for name, n in zip(names, scored, strict=True)
    )
    if rewarded == 0:
        return (
            f"no usable reward: every reward function returned None for every completion (at step {step}: "
            f"{per_function}), so GRPO has no advantage to learn from (loss 0, gradient 0)"
        )
    return (
        f"no usable reward: within every group of {generations} completions of a prompt the reward was the same "
        f"(zero variance in every group), so every advantage is 0 (at step {step}: {rewarded} of {completions} "
        f"completions rewarded; {per_function})"
    )


def no_signal_fix(counts: Sequence[int]) -> str:
    """What to do about a step without a learning signal (``counts`` as :func:`no_signal_message`)."""
    if counts[2] == 0:
        return (
            "Make the reward function return a float for the completions it can score (None marks one it cannot): "
            "check the dataset columns it reads and what it expects of a completion"
        )
    return (
        "Give the rewards a spread within a group: raise num_generations or temperature, or use a reward with "
        "partial credit (the task may be out of the model's reach, or always solved)"
    )


def completion_rows(
    prompts: Sequence[Any],
    completions: Sequence[str],
    per_function: torch.Tensor,
    advantages: torch.Tensor,
    names: Sequence[str],
    step: int,
) -> list[dict[str, Any]]:
    """TRL's ``log_completions`` table rows: step, prompt, completion, each reward function's value (None where
    it returned None) and the advantage."""
    rows = []
    for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        row: dict[str, Any] = {"step": step, "prompt": prompt, "completion": completion}
        for j, name in enumerate(names):
            value = float(per_function[i, j])
            row[name] = None if math.isnan(value) else value
        row["advantage"] = float(advantages[i])
        rows.append(row)
    return rows
