"""The SFT recipe's data: sources -> tokenized examples (rank 0 first, cached) -> packed rows or padding-free
batches when asked -> the sharded sampler and the stream of micro-batches, and the step count."""

from __future__ import annotations

import logging
from typing import Any

from hf_fsdp2.collectives import rank0_first
from hf_fsdp2.config import ConfigError
from hf_fsdp2.data.loader import PaddingCollator
from hf_fsdp2.data.mixture import build_sft_datasets_from_config
from hf_fsdp2.data.packing import PackedCollator, layout_summary, pack_examples
from hf_fsdp2.data.tokenize import TokenizeStats
from hf_fsdp2.run.data import TrainData, check_one_step, examples_per_step, logged_layout, sampled_stream
from hf_fsdp2.run.session import Session

logger = logging.getLogger("hf_fsdp2")


def check_has_targets(stats: list[TokenizeStats], train_counts: list[int], max_length: int) -> None:
    """Refuse training data in which no example has a target token: the run would train to its end at loss 0.

    Args:
        stats: each training source's tokenize stats (in the order of ``train_counts``; eval sources after).
        train_counts: examples each training source contributes to the mixture.
        max_length: the run's max_length, for the message.

    Raises:
        ConfigError: every used example has no target token, naming the sources, the counts and the likely cause.
    """
    used = [s for s, n in zip(stats, train_counts, strict=False) if n > 0]
    if not used or any(s.num_kept > s.num_without_targets for s in used):
        return
    kept = sum(s.num_kept for s in used)
    truncated = sum(s.num_truncated for s in used)
    cause = (
        f"{truncated} of the {kept} examples were cut at max_length={max_length}: their prompts fill it and the "
        "completions are cut off; raise max_length, or shorten the prompts"
        if truncated
        else "the loss mask covers every token (assistant_only_loss / completion_only_loss / chat_loss, or "
        "records without an assistant turn or completion); check the records and those settings"
    )
    raise ConfigError(
        f"no training example has a target token, so the run would train at loss 0 "
        f"({', '.join(s.source for s in used)}: {kept} examples, all without targets): {cause}. "
        "`hf-fsdp2 show-data` shows which tokens train"
    )


def build_sft_data(session: Session, tokenizer: Any) -> TrainData:
    """Tokenize the run's sources and build the stream of micro-batches (every rank; rank 0 tokenizes first).

    Raises:
        ConfigError / ValueError / FileNotFoundError: bad data, raised on every rank as one error.
    """
    cfg = session.cfg
    d, t = cfg.data, cfg.train
    # Rank 0 tokenizes and writes the datasets cache; the other ranks then load it instead of tokenizing.
    # A failure (a missing file, a bad record) is raised on every rank as one error.
    data = rank0_first(lambda: build_sft_datasets_from_config(d, tokenizer, seed=t.seed))
    for line in data.summary_lines(d.max_length):
        logger.info(line)
    check_has_targets(data.stats, data.train_counts, d.max_length)
    d.padding_free = logged_layout(session, "as_configured").padding_free
    # Packed once, deterministically, before sampling: the sampler indexes rows, so resume stays O(1).
    dataset = pack_examples(data.train, d.max_length) if d.packing else data.train
    collator = (
        PackedCollator(pad_token_id=tokenizer.pad_token_id, padding_free=d.padding_free)
        if d.packing or d.padding_free
        else PaddingCollator(pad_token_id=tokenizer.pad_token_id)
    )
    logger.info(
        layout_summary(
            data.train,
            dataset if d.packing else None,
            batch_size=t.per_device_train_batch_size,
            world_size=session.data_world,
            seed=t.seed,
            padding_free=d.padding_free,
        )
    )
    per_step = examples_per_step(session)
    check_one_step(session, len(dataset), "packed rows" if d.packing else "examples", "dataset")
    stream, steps_per_epoch, total_steps = sampled_stream(session, dataset, collator)
    logger.info(
        "training %d steps (%d per epoch), %d examples per step", total_steps, steps_per_epoch, per_step
    )
    return TrainData(
        stream=stream,
        collator=collator,
        eval_set=data.eval,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        examples_per_step=per_step,
    )
