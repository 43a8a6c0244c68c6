"""What a GRPO step and a generation batch are, as TRL 1.16's ``GRPOConfig`` defines them.

``per_device_train_batch_size`` counts completions: one micro-batch of a rank holds that many. A generation batch
is ``generation_batch_size`` completions over every data-parallel rank (``generation_batch_size /
num_generations`` prompts, each sampled ``num_generations`` times), which feeds ``steps_per_generation`` micro-batches
per rank; it is trained on ``num_iterations`` times, so it is sampled once every ``steps_per_generation x
num_iterations`` micro-batches (``generate_every``). A step (what the schedule, logging, ``max_steps`` and checkpoints
count) is one optimizer update: ``gradient_accumulation_steps`` micro-batches. Defaults, as TRL:
``steps_per_generation = gradient_accumulation_steps`` (one generation batch per update, trained on
``num_iterations`` updates in a row).

Every rank reads the same prompts of a generation batch (one stream batch of ``generation_batch_size /
num_generations`` prompts) and generates its own contiguous ``generation_batch_size / ranks`` completions of the
repeated list, so a prompt's group may span ranks, as TRL's; the rewards are gathered to normalise the groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hf_fsdp2.config.plans import check
from hf_fsdp2.data.loader import DataStream, ShardedSampler, build_dataloader


@dataclass(frozen=True, kw_only=True)
class GenerationLayout:
    """A run's generation batches and steps (module docstring), checked by :func:`generation_layout`."""

    per_device: int  # completions per micro-batch per rank
    ranks: int  # data-parallel ranks
    gradient_accumulation_steps: int
    steps_per_generation: int
    generation_batch_size: int  # completions over every rank
    num_generations: int
    num_iterations: int
    rollout_batch_size: int  # completions per generate call of a rank

    @property
    def prompts(self) -> int:
        """Prompts of one generation batch (every rank reads them all)."""
        return self.generation_batch_size // self.num_generations

    @property
    def per_rank(self) -> int:
        """Completions a rank generates per generation batch: ``per_device x steps_per_generation``."""
        return self.generation_batch_size // self.ranks

    @property
    def generate_every(self) -> int:
        """Micro-batches between two generation batches (TRL's ``steps_per_generation x num_iterations``)."""
        return self.steps_per_generation * self.num_iterations

    @property
    def rollout_chunks(self) -> int:
        """Generate calls per generation batch on every rank (the same count on each: rank symmetry)."""
        return math.ceil(self.per_rank / self.rollout_batch_size)

    @property
    def needs_old_logps(self) -> bool:
        """TRL's rule: the sampler's log-probs are kept when a generation batch outlives one optimizer step
        (``gradient_accumulation_steps % generate_every != 0``); otherwise the ratio is taken against the current
        log-probs (detached: 1)."""
        return self.gradient_accumulation_steps % self.generate_every != 0

    def generations_in(self, step: int) -> int:
        """Generation batches sampled during ``step`` (1-based) from its start on a clean run."""
        ga, every = self.gradient_accumulation_steps, self.generate_every
        first, end = (step - 1) * ga, step * ga  # micro-batches [first, end)
        return -(-end // every) - -(-first // every)

    def steps_per_epoch(self, prompts: int) -> int:
        """Optimizer steps that the generation batches of ``prompts`` prompts feed (at least 1)."""
        batches = prompts // self.prompts
        return max(1, batches * self.generate_every // self.gradient_accumulation_steps)


def completion_runs(start: int, stop: int, n: int) -> list[tuple[int, int, int]]:
    """Completions ``[start, stop)`` of a generation batch whose prompt ``j`` owns completions ``[j n, (j + 1) n)``,
    as runs ``(prompt j, first completion, count)``: one vLLM request per run (``n`` = its count, seed = the
    rollout's seed + its first completion, so completion ``k`` is drawn with seed + ``k`` however the batch is split
    between requests, ranks or engines)."""
    runs, k = [], start
    while k < stop:
        j = k // n
        end = min(stop, (j + 1) * n)
        runs.append((j, k, end - k))
        k = end
    return runs


def generation_layout(
    *,
    per_device: int,
    ranks: int,
    gradient_accumulation_steps: int,
    num_generations: int,
    num_iterations: int,
    generation_batch_size: int | None,
    steps_per_generation: int | None,
    rollout_batch_size: int | None,
) -> GenerationLayout:
    """The layout TRL's ``GRPOConfig.__post_init__`` derives, with its checks.

    Raises:
        ConfigError: both keys set, a generation batch that is not whole micro-batches of every rank, or not whole
            groups of ``num_generations``; each naming the numbers and the fix.
    """
    global_batch = per_device * ranks
    check(
        generation_batch_size is None or steps_per_generation is None,
        f"generation_batch_size={generation_batch_size} and steps_per_generation={steps_per_generation} are both "
        "set: set one (the other follows from it)",
    )
    if generation_batch_size is None:
        spg = steps_per_generation or gradient_accumulation_steps
        generation_batch_size = global_batch * spg
    else:
        check(
            generation_batch_size % global_batch == 0,
            f"generation_batch_size ({generation_batch_size}) must be divisible by the global batch size "
            f"per_device_train_batch_size({per_device}) x data-parallel ranks({ranks}) = {global_batch}: set it "
            f"to a multiple of {global_batch}, or set steps_per_generation instead",
        )
        spg = generation_batch_size // global_batch
    check(
        generation_batch_size % num_generations == 0,
        f"generation_batch_size ({generation_batch_size} = per_device_train_batch_size({per_device}) x "
        f"data-parallel ranks({ranks}) x steps_per_generation({spg})) must be divisible by num_generations "
        f"({num_generations}): every prompt's group is whole. per_device_train_batch_size counts completions (as "
        f"TRL's): set it, steps_per_generation or generation_batch_size so that the product is a multiple of "
        f"{num_generations}",
    )
    per_rank = generation_batch_size // ranks
    return GenerationLayout(
        per_device=per_device,
        ranks=ranks,
        gradient_accumulation_steps=gradient_accumulation_steps,
        steps_per_generation=spg,
        generation_batch_size=generation_batch_size,
        num_generations=num_generations,
        num_iterations=num_iterations,
        rollout_batch_size=min(rollout_batch_size or per_rank, per_rank),
    )


def layout_of(cfg: object, ranks: int) -> GenerationLayout:
    """:func:`generation_layout` of a parsed GRPO recipe on ``ranks`` data-parallel ranks."""
    t, g = cfg.train, cfg.method  # type: ignore[attr-defined]
    return generation_layout(
        per_device=t.per_device_train_batch_size,
        ranks=ranks,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        num_generations=g.num_generations,
        num_iterations=g.num_iterations,
        generation_batch_size=g.generation_batch_size,
        steps_per_generation=g.steps_per_generation,
        rollout_batch_size=g.rollout_batch_size,
    )


class GenerationStream(DataStream):
    """The prompt stream, every rank reading the same prompts: its position is each rank's own checkpoint state
    (the run's step adds its buffered generation batch beside it, :class:`~hf_fsdp2.train.step.Step`), resumed as it
    was saved whatever the world size."""

    __slots__ = ()  # the stream's own fields only, as DataStream

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batches_in_epoch": self.batches_in_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.start_at(state["epoch"], state["batches_in_epoch"])


def generation_stream(session: Any, train: Any, collator: Any) -> tuple[Any, int, int, GenerationLayout]:
    """The stream of generation batches' prompts (one stream batch per generation batch; every rank reads the same
    prompts, in the run's seeded order) and the run's step counts: ``max_steps`` when set, else
    ``num_train_epochs`` of :meth:`GenerationLayout.steps_per_epoch`.

    Raises:
        ConfigError: a bad layout (:func:`generation_layout`), or fewer prompts than one generation batch.
    """
    t = session.cfg.train
    layout = layout_of(session.cfg, session.data_world)
    check(
        len(train) >= layout.prompts,
        f"one generation batch needs generation_batch_size({layout.generation_batch_size}) / num_generations"
        f"({layout.num_generations}) = {layout.prompts} prompts but the data has {len(train)}; lower "
        "per_device_train_batch_size, steps_per_generation or generation_batch_size",
    )
    sampler = ShardedSampler(
        len(train), rank=0, world_size=1, seed=t.seed, shuffle=t.train_sampling_strategy == "random"
    )
    loader = build_dataloader(
        train,
        batch_size=layout.prompts,
        collator=collator,
        sampler=sampler,
        num_workers=session.cfg.data.dataloader_num_workers,
    )
    steps_per_epoch = layout.steps_per_epoch(len(train))
    total = t.max_steps if t.max_steps > 0 else math.ceil(t.num_train_epochs * steps_per_epoch)
    return GenerationStream(loader, sampler, layout.prompts), steps_per_epoch, total, layout
