"""The KTO recipe's data: unpaired examples (:mod:`hf_fsdp2.data.unpaired`; or pairs, unpaired first) with their KL
completions, and the stream of micro-batches."""

from __future__ import annotations

import logging
from typing import Any

from hf_fsdp2.collectives import rank0_first
from hf_fsdp2.config import ConfigError
from hf_fsdp2.data.preference_sets import PairList, load_pairs
from hf_fsdp2.data.unpaired import UnpairedCollator, with_kl_completions
from hf_fsdp2.methods.kto.config import KtoArgs
from hf_fsdp2.run.data import TrainData, check_one_step, examples_per_step, sampled_stream
from hf_fsdp2.run.session import Session

logger = logging.getLogger("hf_fsdp2")


def build_kto_data(session: Session, tokenizer: Any) -> TrainData:
    """Tokenize the run's unpaired (or paired, unpaired first) examples, give each its KL completion, and build the
    stream of micro-batches (every rank; rank 0 tokenizes first, so a bad record is one error on every rank).

    Raises:
        ConfigError / ValueError / FileNotFoundError: bad data or settings, naming the source and record.
    """
    cfg = session.cfg
    d, t = cfg.data, cfg.train
    p: KtoArgs = cfg.method
    if d.packing or d.padding_free:
        raise ConfigError(
            f"packing={d.packing}, padding_free={d.padding_free}: the KTO recipe batches each example's row and its KL "
            "row padded side by side; set both to false"
        )
    train, eval_examples = rank0_first(lambda: load_pairs(d, t.seed, tokenizer, unpaired=True))
    uses_kl = p.loss_type == "kto"
    if uses_kl:
        train = PairList(
            with_kl_completions(
                train, world_size=session.data_world, batch_size=t.per_device_train_batch_size
            )
        )
        if eval_examples is not None:
            eval_batch = cfg.observe.per_device_eval_batch_size or t.per_device_train_batch_size
            eval_examples = PairList(
                with_kl_completions(eval_examples, world_size=session.data_world, batch_size=eval_batch)
            )
    collator = UnpairedCollator(pad_token_id=tokenizer.pad_token_id, max_length=d.max_length, kl=uses_kl)
    per_step = examples_per_step(session)
    check_one_step(session, len(train), "examples", "data")
    stream, steps_per_epoch, total_steps = sampled_stream(session, train, collator)
    good = sum(1 for e in train if e["label"])
    logger.info(
        "KTO data: %d training examples (%d desirable, %d undesirable), %s; %d steps (%d per epoch), %d examples per "
        "step (%d rows)",
        len(train),
        good,
        len(train) - good,
        f"{len(eval_examples)} eval examples" if eval_examples else "no eval set",
        total_steps,
        steps_per_epoch,
        per_step,
        (2 if uses_kl else 1) * per_step,
    )
    _warn_balance(good, len(train) - good, p.desirable_weight, p.undesirable_weight)
    return TrainData(
        stream=stream,
        collator=collator,
        eval_set=eval_examples,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        examples_per_step=per_step,
        train_set=train,
    )


def _warn_balance(good: int, bad: int, w_good: float, w_bad: float) -> None:
    """TRL's advice (the KTO paper's eq. 8): with unequal counts, ``w_d·n_d / (w_u·n_u)`` in ``[1, 4/3]``; with one
    kind only, the other kind's weight weights nothing (said, with what the loss then does)."""
    if not good or not bad:
        if good:
            unused, used, moves = f"undesirable_weight={w_bad:g}", f"desirable_weight={w_good:g}", "raises"
            fix = "add examples with label false, or train on the desirable ones with recipes/sft.py"
        else:
            unused, used, moves = f"desirable_weight={w_good:g}", f"undesirable_weight={w_bad:g}", "lowers"
            fix = "add examples with label true"
        logger.warning(
            "KTO data has %d desirable and %d undesirable examples: one kind only, so %s does nothing (no example "
            "of its kind) and %s only scales every example's loss alike; the loss only %s those completions' "
            "reward against the reference point, with no other kind to contrast them with. To train KTO as "
            "intended, %s",
            good,
            bad,
            unused,
            used,
            moves,
            fix,
        )
        return
    if good == bad:
        return
    ratio = w_good * good / (w_bad * bad)
    if not 1 <= ratio <= 4 / 3:
        logger.warning(
            "KTO: %d desirable x desirable_weight %g / (%d undesirable x undesirable_weight %g) = %.2f, outside [1, "
            "4/3] (the KTO paper's eq. 8); e.g. desirable_weight %.2f, or undesirable_weight %.2f",
            good,
            w_good,
            bad,
            w_bad,
            ratio,
            bad * w_bad / good,
            good * w_good / bad,
        )
