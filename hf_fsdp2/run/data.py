"""What every method's data builder returns (:class:`TrainData`: the stream of micro-batches, the eval set, the step
count) and the pieces they share: the batch layout decision, the step-size checks, the sharded sampled stream, and the
preference pairs' stream (DPO's and the reward model's data)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from hf_fsdp2.attention_layout import AttentionLayout, attention_layout_for
from hf_fsdp2.collectives import rank0_first
from hf_fsdp2.config import ConfigError
from hf_fsdp2.data.loader import DataStream, ShardedSampler, build_dataloader
from hf_fsdp2.data.pairs import PreferenceCollator
from hf_fsdp2.data.preference_sets import load_pairs
from hf_fsdp2.run.session import Session

logger = logging.getLogger("hf_fsdp2")


@dataclass(frozen=True, kw_only=True)
class TrainData:
    """What the loop reads: the stream of micro-batches, the eval set, and how many steps the run takes. Frozen: a
    method's objective cannot write into it once ``build_data`` returned; what a step reads per step and keeps across
    steps it says itself (:class:`~hf_fsdp2.train.step.Step`'s ``reads`` and ``buffer_state``)."""

    stream: DataStream
    collator: Any
    eval_set: Any
    steps_per_epoch: int
    total_steps: int
    examples_per_step: int
    train_set: Any = None  # the training examples (the DPO recipe's reference pass reads them)
    processor: Any = None  # an image run's processor: the model then runs its vision tower in every forward


def logged_layout(session: Session, batch_rows: str) -> AttentionLayout:
    """The run's batch layout and attention kernel, decided once from config + environment (the same on every rank,
    the same as the memory plan's), logged in one line; a dense-mask cost the user asked for is warned about.

    Args:
        session: the run (config, model config, device).
        batch_rows: the method's :attr:`~hf_fsdp2.run.method.Method.batch_rows` (which settings decide packing
            and padding-free rows).

    Returns:
        The decided layout.
    """
    layout = attention_layout_for(
        session.cfg, session.model_config, device_type=session.device.type, batch_rows=batch_rows
    )
    logger.info(layout.describe())
    if layout.warning:
        logger.warning(layout.warning)
    return layout


def examples_per_step(session: Session) -> int:
    """Examples (rows, pairs) one optimizer step reads across all ranks."""
    t = session.cfg.train
    return session.data_world * t.per_device_train_batch_size * t.gradient_accumulation_steps


def check_one_step(session: Session, count: int, unit: str, holder: str) -> None:
    """Refuse data smaller than one optimizer step.

    Args:
        session: the run (world size, batch settings).
        count: how many ``unit`` the data has.
        unit: what one example is (``examples``, ``packed rows``, ``pairs``), for the message.
        holder: what holds them (``dataset``, ``data``), for the message.

    Raises:
        ConfigError: ``count`` is under one step, naming the factors and the fix.
    """
    t = session.cfg.train
    per_step = examples_per_step(session)
    if count < per_step:
        raise ConfigError(
            f"one optimizer step needs {session.data_ranks_named} x per_device_train_batch_size"
            f"({t.per_device_train_batch_size}) x gradient_accumulation_steps({t.gradient_accumulation_steps}) "
            f"= {per_step} {unit} but the {holder} has {count}; lower the batch size or the accumulation"
        )


def sampled_stream(session: Session, dataset: Any, collator: Any) -> tuple[DataStream, int, int]:
    """This rank's sharded, seeded sampler over ``dataset``, its loader and the run's step counts.

    Args:
        session: the run (rank, world size, data and train settings).
        dataset: an indexable set of examples (rows, pairs).
        collator: turns a list of examples into a micro-batch.

    Returns:
        The stream of micro-batches, the optimizer steps per epoch, and the run's total steps (``max_steps`` when
        set, else ``num_train_epochs`` worth).
    """
    d, t = session.cfg.data, session.cfg.train
    sampler = ShardedSampler(
        len(dataset),
        rank=session.data_rank,
        world_size=session.data_world,
        seed=t.seed,
        shuffle=t.train_sampling_strategy == "random",
    )
    loader = build_dataloader(
        dataset,
        batch_size=t.per_device_train_batch_size,
        collator=collator,
        sampler=sampler,
        num_workers=d.dataloader_num_workers,
    )
    steps_per_epoch = len(loader) // t.gradient_accumulation_steps
    total_steps = t.max_steps if t.max_steps > 0 else math.ceil(t.num_train_epochs * steps_per_epoch)
    return DataStream(loader, sampler, t.per_device_train_batch_size), steps_per_epoch, total_steps


def build_pair_data(session: Session, tokenizer: Any, recipe: str) -> TrainData:
    """Tokenize the run's preference pairs and build the stream of micro-batches, chosen rows then rejected rows
    (every rank; rank 0 tokenizes first): the DPO and reward-model recipes' data (``recipe`` names it in messages).

    Raises:
        ConfigError / ValueError / FileNotFoundError: bad data, raised on every rank as one error.
    """
    d = session.cfg.data
    if d.packing or d.padding_free:
        raise ConfigError(
            f"packing={d.packing}, padding_free={d.padding_free}: the {recipe} recipe batches each pair's chosen and "
            "rejected rows padded side by side; set both to false"
        )
    train, eval_pairs = rank0_first(lambda: load_pairs(d, session.cfg.train.seed, tokenizer))
    collator = PreferenceCollator(pad_token_id=tokenizer.pad_token_id, max_length=d.max_length)
    per_step = examples_per_step(session)
    check_one_step(session, len(train), "pairs", "data")
    stream, steps_per_epoch, total_steps = sampled_stream(session, train, collator)
    logger.info(
        "%s data: %d training pairs, %s; %d steps (%d per epoch), %d pairs per step (%d rows)",
        recipe,
        len(train),
        f"{len(eval_pairs)} eval pairs" if eval_pairs else "no eval set",
        total_steps,
        steps_per_epoch,
        per_step,
        2 * per_step,
    )
    return TrainData(
        stream=stream,
        collator=collator,
        eval_set=eval_pairs,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        examples_per_step=per_step,
        train_set=train,
    )
