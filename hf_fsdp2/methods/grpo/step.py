"""GRPO's steps on one rank, with TRL 1.16's batch and step meaning (:mod:`.batching`): a step is one optimizer
update over ``gradient_accumulation_steps`` micro-batches of ``per_device_train_batch_size`` completions, taken from
a buffered generation batch; a new generation batch is sampled every ``steps_per_generation x num_iterations``
micro-batches.

A generation batch: every rank reads the same prompts (one stream batch), repeats each ``num_generations`` times and
generates its own contiguous share of the completions (:mod:`.rollout`, ``rollout_batch_size`` per generate call,
the same number of calls on every rank), scores them (:mod:`.rewards`), and gathers every rank's rewards, so groups
are normalised as TRL's whatever rank they fell on. The sampler's log-probs are kept when the batch outlives one
optimizer step (TRL's rule, :attr:`~.batching.GenerationLayout.needs_old_logps`), the reference's when ``beta`` > 0.

The loss of a step is TRL's: each micro-batch's numerator (:func:`~.loss.grpo_loss_sums`) over its normaliser
(completions of the step for grpo and dr_grpo, the step's micro-batches for bnpo, and for dapo the generation
batch's completion tokens x ``gradient_accumulation_steps / steps_per_generation``), summed over the micro-batches
and ranks. Every rank runs the same collectives whatever its completions: the same generations, forwards, backwards
and one count all-reduce per step.

Resuming: the buffered generation batch (rows, advantages, the sampler's and the reference's log-probs, its
metrics) is each rank's part of a checkpoint (:class:`~.batching.GenerationStream`), so a run resumed inside a
generation batch trains on the same completions as the uninterrupted one (on the same number of ranks, as every
per-rank data position). A stepper started without a buffer inside a generation batch samples a new one first, as
TRL's empty buffer does.

A step with no completion of non-zero advantage on any rank has nothing to learn from: the run's guard stops the
run (or warns, ``on_collapse``) after ``COLLAPSE_STEPS`` such steps in a row, naming the reward functions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hf_fsdp2 import collectives
from hf_fsdp2.methods.grpo.batching import GenerationLayout
from hf_fsdp2.methods.grpo.loss import (
    GrpoSettings,
    group_advantages,
    grpo_loss_sums,
    high_entropy_mask,
    token_logps_and_entropy,
)
from hf_fsdp2.methods.grpo.metrics import (
    STATS,
    GrpoStepMetrics,
    Rollout,
    completion_rows,
    no_signal_fix,
    no_signal_message,
    signal_counts,
)
from hf_fsdp2.methods.grpo.rewards import RewardError, RewardFunction, combine, score_completions
from hf_fsdp2.methods.grpo.rollout import Generator, is_clipped, rollout_seed
from hf_fsdp2.methods.grpo.vllm.importance import attach_sampling_logps
from hf_fsdp2.train.loss import LossPlan
from hf_fsdp2.train.nonfinite import NonFiniteGuard
from hf_fsdp2.train.step import (
    Batch,
    LossTerm,
    MicroLoss,
    StepCounts,
    StepLoss,
    StepOutput,
    StepSettings,
    train_step,
)

__all__ = ["GrpoStepper", "Rollout", "no_signal_fix", "no_signal_message", "signal_counts"]


@dataclass(frozen=True, kw_only=True)
class GrpoStepSettings:
    """GRPO's own step settings (how the shared skeleton runs, the loss plan included, is
    :class:`~hf_fsdp2.train.step.StepSettings`)."""

    grpo: GrpoSettings
    temperature: float
    num_iterations: int
    seed: int
    layout: GenerationLayout | None = None  # required by GrpoStepper
    mask_truncated_completions: bool = False
    top_entropy_quantile: float = 1.0
    log_completions: bool = False
    num_completions_to_print: int | None = None


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


def _generate(
    generator: Generator,
    unique: list[Sequence[int]],
    share: slice,
    layout: GenerationLayout,
    seed: int,
    number: int,
) -> list[list[int]]:
    """This rank's ``share`` of the generation batch's completions (``unique``: its prompts, each owning
    ``num_generations`` consecutive completions). A vLLM generator (``generate_groups``) takes the whole batch in
    one engine call, each prompt once with its ``n`` samples; transformers' generates this rank's repeated prompts
    in ``rollout_chunks`` calls (the same count on every rank)."""
    grouped = getattr(generator, "generate_groups", None)
    if grouped is not None:
        return grouped(unique, layout.num_generations, share, seed=rollout_seed(seed, number, 0))  # type: ignore[no-any-return]
    prompts = [p for p in unique for _ in range(layout.num_generations)][share]
    rank, size = collectives.rank(), layout.rollout_batch_size
    out: list[list[int]] = []
    for chunk in range(layout.rollout_chunks):
        part = prompts[chunk * size : (chunk + 1) * size]
        out += generator.generate(part, seed=rollout_seed(seed, number, rank + chunk * layout.ranks))
    return out


def rollout(
    batch: dict[str, Any],
    generator: Generator,
    functions: Sequence[RewardFunction],
    tokenizer: Any,
    settings: GrpoStepSettings,
    *,
    number: int,
    device: torch.device,
) -> Rollout:
    """Sample, score and normalise one generation batch (``batch``: its prompts, the same on every rank; every rank
    calls it). ``number``: the generation batch's 1-based number (its sampling seeds)."""
    layout = settings.layout
    assert layout is not None
    g, rank = settings.grpo.num_generations, collectives.rank()
    share = slice(rank * layout.per_rank, (rank + 1) * layout.per_rank)
    repeated = [p for p in batch["prompt_ids"] for _ in range(g)][share]
    completion_ids = _generate(generator, list(batch["prompt_ids"]), share, layout, settings.seed, number)
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    raw_prompts = [p for p in batch["prompts"] for _ in range(g)][share]
    columns = {key: [v for v in values for _ in range(g)][share] for key, values in batch["columns"].items()}
    indices = [i for i in batch["index"] for _ in range(g)][share]
    # A function that raises on one rank's completions stops every rank here, with its name and the example.
    table = collectives.run_on_all(
        "scoring the completions",
        lambda: score_completions(functions, raw_prompts, texts, completion_ids, columns, indices=indices),
        RewardError,
    )
    ends = [*generator.eos_ids, int(tokenizer.pad_token_id)]
    truncated = [settings.mask_truncated_completions and is_clipped(c, ends) for c in completion_ids]
    in_loss = [0 if cut else len(c) for c, cut in zip(completion_ids, truncated, strict=True)]
    # Every rank's rewards and loss tokens in one gather: groups may span ranks (TRL's gather of the rewards).
    functions_n = table.shape[1]
    gathered = collectives.gather_rows([*table.flatten().tolist(), *map(float, in_loss)], device)
    everyone = gathered[:, : layout.per_rank * functions_n].reshape(-1, functions_n).to(table.dtype)
    loss_tokens = int(gathered[:, layout.per_rank * functions_n :].sum())
    all_rewards = combine(everyone, functions)
    all_advantages, all_zero = group_advantages(all_rewards, settings.grpo)
    advantages, zero_std, rewards = all_advantages[share], all_zero[share], all_rewards[share]
    whole = Rollout(
        rows=[],
        rewards=all_rewards,
        per_function=everyone,
        advantages=all_advantages,
        zero_std=all_zero,
        lengths=[],
        completions=[],
        prompts=[],
    )
    rows = []
    for j in range(layout.steps_per_generation):
        part = slice(j * layout.per_device, (j + 1) * layout.per_device)
        row = _rows(repeated[part], completion_ids[part], tokenizer.pad_token_id)
        row["advantages"] = advantages[part]
        keep = torch.tensor([not cut for cut in truncated[part]], dtype=torch.long)
        row["loss_mask"] = row["completion_mask"] * keep[:, None]
        rows.append(row)
    attach_sampling_logps(rows, generator)  # vLLM's log-probs of what it sampled (importance sampling)
    return Rollout(
        rows=rows,
        rewards=rewards,
        per_function=table,
        advantages=advantages,
        zero_std=zero_std,
        lengths=[len(c) for c in completion_ids],
        completions=texts,
        prompts=raw_prompts,
        clipped=sum(is_clipped(c, generator.eos_ids) for c in completion_ids),
        signal=signal_counts(whole),
        loss_tokens=loss_tokens,
    )


def score_rows(
    model: torch.nn.Module,
    row: dict[str, torch.Tensor],
    temperature: float,
    device: torch.device,
    plan: LossPlan | None = None,
    *,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropies) of a micro-batch's completions (chunked under ``plan``)."""
    return token_logps_and_entropy(
        model,
        row["input_ids"].to(device),
        row["attention_mask"].to(device),
        row["completion_mask"],
        temperature,
        plan,
        entropy=entropy,
    )


def no_grad_logps(
    model: torch.nn.Module,
    row: dict[str, torch.Tensor],
    temperature: float,
    device: torch.device,
    plan: LossPlan | None = None,
) -> torch.Tensor:
    """Per-token log-probs without gradient, in eval mode (no dropout); the mode is restored."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            return score_rows(model, row, temperature, device, plan)[0]
    finally:
        model.train(was)


def _pooled_entropies(values: torch.Tensor) -> torch.Tensor:
    """Every rank's completion-token entropies of this micro-batch (TRL pads across the processes and gathers)."""
    counts = collectives.gather_rows([float(values.numel())], values.device)
    width = int(counts.max())
    padded = torch.full((width,), -1e9, dtype=torch.float64)
    padded[: values.numel()] = values.detach().double().cpu()
    rows = collectives.gather_rows(padded.tolist(), values.device).flatten()
    return rows[rows != -1e9].float()


class GrpoStepper:
    """The GRPO step function of a run (the loop calls it once per optimizer step), holding the generation batch
    across steps; :meth:`reads` tells the loop how many prompt batches a step takes from the stream."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        *,
        generator: Generator,
        functions: Sequence[RewardFunction],
        tokenizer: Any,
        reference: Callable[[dict[str, torch.Tensor]], torch.Tensor] | None,
        settings: GrpoStepSettings,
        step: StepSettings,
        device: torch.device,
    ) -> None:
        if settings.layout is None:
            raise ValueError("GrpoStepper needs settings.layout (batching.layout_of)")
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        # The run's loss plan chunks the scoring; the skeleton adds no router loss: GRPO's policy loss alone trains
        # the router (the objective says so at start-up).
        self.plan = step.loss
        self.step_settings = dataclasses.replace(
            step, loss=dataclasses.replace(step.loss, router_aux_coef=0.0)
        )
        self.generator, self.functions, self.tokenizer = generator, list(functions), tokenizer
        self.reference, self.settings, self.device = reference, settings, device
        self.layout: GenerationLayout = settings.layout
        self.roll: Rollout | None = None
        self.table: list[dict[str, Any]] = []
        self.table_sink: Callable[[list[dict[str, Any]]], None] | None = None  # trackers' tables (rank 0)

    def _starts(self, step: int) -> list[bool]:
        """Per micro-batch of ``step``: whether it starts a generation batch (the first one after a start inside
        a generation batch does, as TRL's empty buffer on resume)."""
        ga, every = self.layout.gradient_accumulation_steps, self.layout.generate_every
        first = (step - 1) * ga
        return [(first + i) % every == 0 or (i == 0 and self.roll is None) for i in range(ga)]

    def reads(self, step: int) -> int:
        """Prompt batches ``step`` reads from the stream (every rank the same)."""
        return sum(self._starts(step))

    def buffer_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of this rank's buffer: the generation batch and the completions table."""
        return {"roll": self.roll, "table": list(self.table)}

    def load_buffer(self, state: dict[str, Any]) -> None:
        """The buffer of a resumed checkpoint (before the first step)."""
        self.roll, self.table[:] = state["roll"], state["table"]

    def _sample(self, batch: dict[str, Any], number: int, step: int) -> Rollout:
        s = self.settings
        roll = rollout(
            batch, self.generator, self.functions, self.tokenizer, s, number=number, device=self.device
        )
        roll.step = step
        correction = getattr(
            self.generator, "correction", None
        )  # vLLM's importance sampling (vllm/importance.py)
        if self.layout.needs_old_logps or correction is not None:
            roll.old = [
                no_grad_logps(self.model, r, s.temperature, self.device, self.plan) for r in roll.rows
            ]
        if correction is not None and roll.old is not None:
            for r, ratio in zip(roll.rows, correction.ratios(roll.old, roll.rows), strict=True):
                r["is_ratio"] = ratio
            roll.sampling = correction.metrics(self.device)
        if self.reference is not None and s.grpo.beta:
            roll.refs = [self.reference(r) for r in roll.rows]
        if s.log_completions:  # every rank takes part; rank 0 keeps the rows
            parts = collectives.gather_objects((roll.prompts, roll.completions))
            prompts = [p for part in parts for p in part[0]]
            texts = [c for part in parts for c in part[1]]
            whole = collectives.gather_rows(
                torch.cat([roll.per_function.flatten(), roll.advantages]).tolist(), self.device
            )
            f = roll.per_function.shape[1]
            per_function = whole[:, : -len(roll.advantages)].reshape(-1, f)
            advantages = whole[:, -len(roll.advantages) :].flatten()
            if collectives.rank() == 0:
                self.table += completion_rows(
                    prompts, texts, per_function, advantages, [fn.name for fn in self.functions], step
                )
        return roll

    def __call__(self, prompt_batches: Sequence[Batch]) -> StepOutput:
        step = (
            int(getattr(self.scheduler, "last_epoch", 0)) + 1
        )  # restored on resume: the same sampling seeds
        layout = self.layout
        ga, spg = layout.gradient_accumulation_steps, layout.steps_per_generation
        pending = list(prompt_batches)
        micro: list[tuple[Rollout, int]] = []
        for i, starts in enumerate(self._starts(step)):
            m = (step - 1) * ga + i
            if starts:
                self.roll = self._sample(pending.pop(0), m // layout.generate_every + 1, step)
            assert self.roll is not None
            micro.append((self.roll, m % spg))
        rows = [roll.rows[j] for roll, j in micro]
        loss = GrpoLoss(self, micro, step)
        trained = [{"input_ids": r["input_ids"], "attention_mask": r["attention_mask"]} for r in rows]
        return train_step(
            self.model,
            self.optimizer,
            self.scheduler,
            rows,
            self.step_settings,
            self.device,
            loss,
            trained=trained,
        )

    def _normaliser(self, roll: Rollout) -> float:
        """What a micro-batch's numerator is divided by (TRL's per loss type, over every rank)."""
        layout, kind = self.layout, self.settings.grpo.loss_type
        ga = layout.gradient_accumulation_steps
        if kind == "dapo":
            return roll.loss_tokens * ga / layout.steps_per_generation
        if kind == "bnpo":
            return float(ga * layout.ranks)
        return float(layout.per_device * ga * layout.ranks)


class GrpoLoss(StepLoss):
    """One GRPO step's loss (:class:`~hf_fsdp2.train.step.StepLoss`) over its micro-batches of completions (each
    ``(roll, j)``: micro-batch ``j`` of a buffered generation batch): TRL's numerator over TRL's normaliser per loss
    type (:meth:`GrpoStepper._normaliser`). The logged loss sum is already normalised (``loss_count`` 1)."""

    log_dtype = torch.float64

    def __init__(self, stepper: GrpoStepper, micro: list[tuple[Rollout, int]], step: int) -> None:
        self.stepper, self.micro_rolls, self.step = stepper, micro, step
        self.stats = torch.zeros(len(STATS), dtype=torch.float64, device=stepper.device)

    def local_counts(self, micro_batches: Sequence[Batch]) -> list[int]:
        return [
            sum(int(r["loss_mask"].sum()) for r in micro_batches),
            sum(r["input_ids"].numel() for r in micro_batches),
        ]

    def begin(self, counts: Sequence[int], guard: NonFiniteGuard | None) -> StepCounts:
        tokens, processed = counts
        st, s = self.stepper, self.stepper.settings
        if guard is not None:
            signal = st.roll.signal if st.roll is not None else []
            silent = all(roll.signal[0] == 0 for roll, _ in self.micro_rolls)
            names = [f.name for f in st.functions]
            guard.no_signal(
                self.step,
                silent,
                lambda: no_signal_message(signal, names, s.grpo.num_generations, self.step),
                no_signal_fix(signal),
            )
        return StepCounts(loss_count=1, loss_units=tokens, target_tokens=tokens, processed_tokens=processed)

    def micro(self, model: torch.nn.Module, batch: Batch, index: int) -> MicroLoss:
        st, s, device = self.stepper, self.stepper.settings, self.stepper.device
        roll, j = self.micro_rolls[index]
        row = batch
        want_entropy = True  # TRL's entropy metric; the top_entropy_quantile mask
        logps, entropies = score_rows(model, row, s.temperature, device, st.plan, entropy=want_entropy)
        mask = row["loss_mask"].to(device)
        entropy_mask = None
        if s.top_entropy_quantile < 1.0:
            assert entropies is not None
            pooled = _pooled_entropies(entropies[mask.bool()])
            entropy_mask = high_entropy_mask(entropies, mask, 1 - s.top_entropy_quantile, pooled.to(device))
        sums = grpo_loss_sums(
            logps,
            roll.old[j] if roll.old else None,
            roll.refs[j] if roll.refs else None,
            row["advantages"].to(device),
            mask,
            s.grpo,
            entropy_mask=entropy_mask,
            entropies=entropies,
            is_ratio=row.get("is_ratio"),
        )
        normaliser = st._normaliser(roll)
        # Nothing in the loss on any rank (normaliser 0): the same backward, a zero gradient.
        logged = (sums.loss.detach().double() / normaliser,) if normaliser > 0 else ()
        self.stats += torch.stack(
            [sums.kl, sums.clipped_low, sums.clipped_high, sums.clip_count, sums.tokens, sums.entropy]
        ).double()
        return MicroLoss((LossTerm(sums.loss, normaliser),), logged)

    def metrics(self, micro_batches: int) -> dict[str, float]:
        st, s = self.stepper, self.stepper.settings
        assert st.roll is not None
        table = st.table if s.log_completions and collectives.rank() == 0 else None
        return GrpoStepMetrics(
            stats=self.stats.cpu(),
            roll=st.roll,
            function_names=[f.name for f in st.functions],
            beta=s.grpo.beta,
            device=st.device,
            functions=st.functions,
            table=table,
            table_limit=s.num_completions_to_print,
            table_sink=st.table_sink,
            timing=getattr(st.generator, "rollout_metrics", None),
        )(micro_batches)
