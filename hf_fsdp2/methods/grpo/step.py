"""One GRPO step on one rank: rollout, rewards, advantages, then ``num_iterations`` optimizer updates on the batch.

A step reads ``gradient_accumulation_steps`` micro-batches of prompts per rank (every rank the same count). Their
prompts, each repeated ``num_generations`` times, are generated in one rollout phase (:mod:`.rollout`: the
policy gathered once), scored by the reward functions (:mod:`.rewards`) and normalised per prompt group (groups
never span ranks; ``scale_rewards: batch`` takes its deviation from an all-reduce every rank runs). The completions
then go through the policy in ``gradient_accumulation_steps`` micro-batches, with the loss of :mod:`.grpo` summed
and divided by the global count (completions, or completion tokens for ``dapo``) of every rank.

With ``num_iterations`` > 1 the same generation batch is trained on that many times (one optimizer update each),
the ratio taken against the log-probs of the policy that sampled it (computed once, without gradient); the
learning-rate schedule moves once per step, after the last update. Every rank runs the same collectives whatever
its completions: one rollout phase, the same number of forwards and backwards, one count all-reduce per update.

A step with no completion of non-zero advantage on any rank (every reward None, or every group's rewards equal)
has nothing to learn from: its counts ride on the step's count all-reduce, and the run's guard stops the run (or
warns, ``on_collapse``) after ``COLLAPSE_STEPS`` such steps in a row, naming the reward functions
(:meth:`hf_fsdp2.train.nonfinite.NonFiniteGuard.no_signal`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hf_fsdp2 import collectives
from hf_fsdp2.methods.grpo.loss import GrpoSettings, completion_token_logps, group_advantages, grpo_loss_sums
from hf_fsdp2.methods.grpo.rewards import RewardError, RewardFunction, combine, score_completions
from hf_fsdp2.methods.grpo.rollout import Generator, rollout_seed
from hf_fsdp2.train.nonfinite import guard_of
from hf_fsdp2.train.step import choose_gradient_sync, clip_and_update, read_step_counts


@dataclass(frozen=True)
class GrpoStepSettings:
    grpo: GrpoSettings
    temperature: float
    num_iterations: int
    max_grad_norm: float
    sync_each_microbatch: bool
    seed: int


@dataclass
class Rollout:
    """A step's generation batch on this rank: rows (prompt left-padded + completion right-padded) per micro-batch."""

    rows: list[dict[str, torch.Tensor]]
    rewards: torch.Tensor  # [completions]
    per_function: torch.Tensor  # [completions, functions]
    advantages: torch.Tensor
    zero_std: torch.Tensor
    lengths: list[int]
    completions: list[str]
    prompts: list[Any]


def _rows(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int
) -> dict[str, torch.Tensor]:
    """One micro-batch of policy rows: the prompt left-padded to the longest, the completion right-padded."""
    width_p = max(len(p) for p in prompts)
    width_c = max(1, max(len(c) for c in completions))
    ids = torch.full((len(prompts), width_p + width_c), pad_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    mask = torch.zeros((len(prompts), width_c), dtype=torch.long)
    for row, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        ids[row, width_p - len(p) : width_p] = torch.tensor(list(p), dtype=torch.long)
        attention[row, width_p - len(p) : width_p] = 1
        if c:
            ids[row, width_p : width_p + len(c)] = torch.tensor(list(c), dtype=torch.long)
            attention[row, width_p : width_p + len(c)] = 1
            mask[row, : len(c)] = 1
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": mask}


def rollout(
    micro_batches: Sequence[dict[str, Any]],
    generator: Generator,
    functions: Sequence[RewardFunction],
    tokenizer: Any,
    settings: GrpoStepSettings,
    *,
    step: int,
    rank: int,
    device: torch.device,
) -> Rollout:
    """Generate, score and normalise this rank's completions of the step (every rank calls it)."""
    g = settings.grpo.num_generations
    prompts = [p for b in micro_batches for p in b["prompt_ids"]]
    repeated = [p for p in prompts for _ in range(g)]
    completion_ids = generator.generate(repeated, seed=rollout_seed(settings.seed, step, rank))
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    raw_prompts = [p for b in micro_batches for p in b["prompts"] for _ in range(g)]
    columns: dict[str, list[Any]] = {}
    for b in micro_batches:
        for key, values in b["columns"].items():
            columns.setdefault(key, []).extend(v for v in values for _ in range(g))
    indices = [i for b in micro_batches for i in b["index"] for _ in range(g)]
    # A function that raises on one rank's completions stops every rank here, with its name and the example (the
    # other ranks would otherwise wait in the next collective); one host all-gather of the outcome per step.
    table = collectives.run_on_all(
        "scoring the completions",
        lambda: score_completions(functions, raw_prompts, texts, completion_ids, columns, indices=indices),
        RewardError,
    )
    rewards = combine(table, functions)
    batch_std = None
    if settings.grpo.scale_rewards == "batch":  # every rank, whatever its rewards: the global deviation
        valid = ~torch.isnan(rewards)
        r = torch.where(valid, rewards, torch.zeros_like(rewards)).double()
        local = torch.stack([valid.sum().double(), r.sum(), (r * r).sum()]).to(device)
        n, s, ss = collectives.all_reduce_sum(local).tolist()
        batch_std = torch.tensor(math.sqrt(max(ss - s * s / n, 0.0) / (n - 1)) if n > 1 else math.nan)
    advantages, zero_std = group_advantages(rewards, settings.grpo, batch_std)
    rows, start = [], 0
    for b in micro_batches:
        count = len(b["prompt_ids"]) * g
        rows.append(
            _rows(
                repeated[start : start + count], completion_ids[start : start + count], tokenizer.pad_token_id
            )
        )
        rows[-1]["advantages"] = advantages[start : start + count]
        start += count
    return Rollout(
        rows, rewards, table, advantages, zero_std, [len(c) for c in completion_ids], texts, raw_prompts
    )


def _logps(model: torch.nn.Module, row: dict[str, torch.Tensor], temperature: float, device: torch.device):  # type: ignore[no-untyped-def]
    width = row["completion_mask"].shape[1]
    return completion_token_logps(
        model, row["input_ids"].to(device), row["attention_mask"].to(device), width, temperature
    )


def no_grad_logps(
    model: torch.nn.Module, row: dict[str, torch.Tensor], temperature: float, device: torch.device
):  # type: ignore[no-untyped-def]
    """Per-token log-probs without gradient, in eval mode (no dropout); the mode is restored."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            return _logps(model, row, temperature, device)
    finally:
        model.train(was)


@dataclass
class GrpoStepOutput:
    """What a GRPO step did (the observer's fields; the statistics are this rank's sums until logged)."""

    loss_sum: torch.Tensor
    count: int
    target_tokens: int
    processed_tokens: int
    grad_norm: torch.Tensor
    lr: float
    stats: torch.Tensor  # kl, clipped low, clipped high (token sums), tokens
    roll: Rollout
    function_names: list[str]
    beta: float
    device: torch.device

    @property
    def loss_count(self) -> int:
        return self.count

    def extra_metrics(self, micro_batches: int) -> dict[str, float]:
        """TRL's names: reward, reward_std, rewards/<fn>/mean|std, completions/*, clip_ratio/*, kl, frac_reward_zero_std
        (collective: every rank calls it)."""
        r, table = self.roll.rewards.double(), self.roll.per_function.double()
        valid = ~torch.isnan(r)
        parts = [self.stats.double().cpu(), torch.stack([valid.sum().double(), r.nan_to_num().sum(),
                 (r.nan_to_num() ** 2).sum(), self.roll.zero_std.double().sum(), torch.tensor(float(r.numel()))])]  # fmt: skip
        for i in range(table.shape[1]):
            col = table[:, i]
            ok = ~torch.isnan(col)
            parts.append(
                torch.stack([ok.sum().double(), col.nan_to_num().sum(), (col.nan_to_num() ** 2).sum()])
            )
        lengths = torch.tensor(self.roll.lengths, dtype=torch.float64)
        parts.append(torch.stack([lengths.sum(), (lengths >= 0).sum().double()]))
        total = collectives.all_reduce_sum(torch.cat(parts).to(self.device)).cpu()
        lows = collectives.all_reduce_max([-float(lengths.min()), float(lengths.max())])
        kl, low, high, tokens = total[:4].tolist()
        n, s, ss, zero, completions = total[4:9].tolist()

        def std(count: float, total_: float, squares: float) -> float:
            return (
                math.sqrt(max(squares - total_ * total_ / count, 0.0) / (count - 1))
                if count > 1
                else math.nan
            )

        out = {"reward": s / n if n else math.nan, "reward_std": std(n, s, ss), "frac_reward_zero_std": zero / completions,
               "clip_ratio/low_mean": low / max(tokens, 1), "clip_ratio/high_mean": high / max(tokens, 1),
               "clip_ratio/region_mean": (low + high) / max(tokens, 1)}  # fmt: skip
        if self.beta:
            out["kl"] = kl / max(tokens, 1)
        at = 9
        for name in self.function_names:
            c, fs, fss = total[at : at + 3].tolist()
            out[f"rewards/{name}/mean"], out[f"rewards/{name}/std"] = (
                (fs / c if c else math.nan),
                std(c, fs, fss),
            )
            at += 3
        length_sum, length_n = total[at : at + 2].tolist()
        out["completions/mean_length"] = length_sum / max(length_n, 1)
        out["completions/min_length"], out["completions/max_length"] = -float(lows[0]), float(lows[1])
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


def grpo_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    micro_batches: Sequence[dict[str, Any]],
    *,
    generator: Generator,
    functions: Sequence[RewardFunction],
    tokenizer: Any,
    reference: Any,
    settings: GrpoStepSettings,
    device: torch.device,
    step: int,
    rank: int,
) -> GrpoStepOutput:
    """One step (module docstring); ``reference``: a callable ``(row) -> [B, T]`` reference log-probs, or None."""
    roll = rollout(
        micro_batches, generator, functions, tokenizer, settings, step=step, rank=rank, device=device
    )
    for batch, row in zip(micro_batches, roll.rows, strict=True):  # what the meter counts: the trained rows
        batch["input_ids"], batch["attention_mask"] = row["input_ids"], row["attention_mask"]
    s = settings.grpo
    dapo = s.loss_type == "dapo"
    local = torch.tensor([
        sum(int(r["completion_mask"].sum()) if dapo else r["completion_mask"].shape[0] for r in roll.rows),
        sum(int(r["completion_mask"].sum()) for r in roll.rows),
        sum(r["input_ids"].numel() for r in roll.rows),
        *signal_counts(roll),
    ], dtype=torch.long)  # fmt: skip
    # The step's one host read of its counts, carrying the previous step's non-finite flags (the guard acts here)
    # and the reward counts every rank decides a step without a learning signal from, alike.
    guard = guard_of(optimizer)
    count, tokens, processed, *signal = read_step_counts(local.to(device), guard)
    if guard is not None:
        silent = signal[0] == 0
        guard.no_signal(
            step,
            silent,
            lambda: no_signal_message(signal, [f.name for f in functions], s.num_generations, step),
            no_signal_fix(signal),
        )
    scale = collectives.world() / count if count else 0.0
    old = (
        [no_grad_logps(model, r, settings.temperature, device) for r in roll.rows]
        if settings.num_iterations > 1
        else None
    )
    refs = [reference(r) for r in roll.rows] if reference is not None and s.beta else None
    grad_norm, lr = torch.zeros(()), 0.0
    for iteration in range(settings.num_iterations):  # the last update's loss and statistics are logged
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        stats = torch.zeros(4, dtype=torch.float64, device=device)
        for i, row in enumerate(roll.rows):
            choose_gradient_sync(model, i, len(roll.rows), settings.sync_each_microbatch)
            logps = _logps(model, row, settings.temperature, device)
            mask = row["completion_mask"].to(device)
            sums = grpo_loss_sums(logps, old[i] if old else None, refs[i] if refs else None,
                                  row["advantages"].to(device), mask, s)  # fmt: skip
            (sums.loss * scale).backward()
            loss_sum += sums.loss.detach().double()
            stats += torch.stack([sums.kl, sums.clipped_low, sums.clipped_high, sums.tokens]).double()
        last = iteration == settings.num_iterations - 1
        grad_norm, lr = clip_and_update(model, optimizer, scheduler if last else None, loss_sum, settings.max_grad_norm,
                                        count)  # fmt: skip
    return GrpoStepOutput(loss_sum, count, tokens, processed, grad_norm, lr, stats.cpu(), roll,
                          [f.name for f in functions], s.beta, device)  # fmt: skip
