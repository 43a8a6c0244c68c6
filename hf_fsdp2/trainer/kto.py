"""The KTO recipe's data and objective: unpaired examples (:mod:`hf_fsdp2.data.unpaired`) with their KL completions,
the reference (as DPO builds it: the LoRA base, a precomputed table, or a frozen sharded copy), the step and the
evaluator (:mod:`hf_fsdp2.train.kto`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hf_fsdp2.collectives import rank0_first
from hf_fsdp2.config import Config, ConfigError
from hf_fsdp2.config.plans import check
from hf_fsdp2.config.training import KTO_LOSS_TYPES
from hf_fsdp2.data.unpaired import UnpairedCollator, with_kl_completions
from hf_fsdp2.train.dpo import Reference
from hf_fsdp2.train.kto import KTOSettings, evaluate_kto, kto_step
from hf_fsdp2.trainer.dpo_data import PairList, load_pairs
from hf_fsdp2.trainer.model import TrainModel
from hf_fsdp2.trainer.objective import Objective, StepFn
from hf_fsdp2.trainer.preference import build_reference
from hf_fsdp2.trainer.session import Session
from hf_fsdp2.trainer.sft_data import TrainData, check_one_step, examples_per_step, sampled_stream

logger = logging.getLogger("hf_fsdp2")


def kto_settings_check(cfg: Config) -> None:
    """The KTO recipe's reading of the preference section (every rank alike, before any loading): the default
    ``loss_type`` (sigmoid, DPO's) means ``kto``; another DPO loss type is refused, as is a per-device batch of 1
    with ``kto`` (its KL estimate would pair each prompt with its own completion: TRL refuses it too).

    Raises:
        ConfigError: naming the value and the fix.
    """
    p, t = cfg.preference, cfg.train
    if p.loss_type == "sigmoid":
        p.loss_type = "kto"
    if p.beta is None:
        p.beta = 0.1  # TRL's KTOConfig default
    check(p.beta > 0, f"beta={p.beta} must be > 0 for KTO")
    check(
        p.loss_type in KTO_LOSS_TYPES,
        f"loss_type={p.loss_type!r} is a paired objective of recipes/dpo.py; the KTO recipe takes "
        f"{' or '.join(KTO_LOSS_TYPES)}",
    )
    for key, value in (("label_smoothing", p.label_smoothing), ("cpo_alpha", p.cpo_alpha)):
        check(not value, f"{key}={value} is a DPO/SimPO setting; KTO has none: set it to 0")
    check(
        p.loss_type != "kto" or t.per_device_train_batch_size > 1,
        f"per_device_train_batch_size={t.per_device_train_batch_size}: KTO estimates its KL reference point from each "
        "micro-batch's prompts paired with the other examples' completions, so it needs at least 2 examples per "
        "micro-batch (TRL refuses 1 too); raise it, or use loss_type apo_zero_unpaired (no KL term)",
    )


def build_kto_data(session: Session, tokenizer: Any) -> TrainData:
    """Tokenize the run's unpaired (or paired, unpaired first) examples, give each its KL completion, and build the
    stream of micro-batches (every rank; rank 0 tokenizes first, so a bad record is one error on every rank).

    Raises:
        ConfigError / ValueError / FileNotFoundError: bad data or settings, naming the source and record.
    """
    cfg = session.cfg
    d, t, p = cfg.data, cfg.train, cfg.preference
    if d.packing or d.padding_free:
        raise ConfigError(
            f"packing={d.packing}, padding_free={d.padding_free}: the KTO recipe batches each example's row and its KL "
            "row padded side by side; set both to false"
        )
    train, eval_examples = rank0_first(lambda: load_pairs(session, tokenizer, unpaired=True))
    uses_kl = p.loss_type == "kto"
    if uses_kl:
        train = PairList(
            with_kl_completions(train, world_size=session.world, batch_size=t.per_device_train_batch_size)
        )
        if eval_examples is not None:
            eval_batch = cfg.observe.per_device_eval_batch_size or t.per_device_train_batch_size
            eval_examples = PairList(
                with_kl_completions(eval_examples, world_size=session.world, batch_size=eval_batch)
            )
    collator = UnpairedCollator(pad_token_id=tokenizer.pad_token_id, max_length=d.max_length, kl=uses_kl)
    per_step = examples_per_step(session)
    check_one_step(session, len(train), "examples", "data")
    stream, steps_per_epoch, total_steps = sampled_stream(session, train, collator)
    good = sum(1 for e in train if e["label"])
    logger.info(
        "KTO data: %d training examples (%d desirable, %d undesirable), %s; %d steps (%d per epoch), %d examples per "
        "step (%d rows)", len(train), good, len(train) - good,
        f"{len(eval_examples)} eval examples" if eval_examples else "no eval set", total_steps, steps_per_epoch,
        per_step, (2 if uses_kl else 1) * per_step,
    )  # fmt: skip
    _warn_balance(good, len(train) - good, p.desirable_weight, p.undesirable_weight)
    return TrainData(stream, collator, eval_examples, steps_per_epoch, total_steps, per_step, train_set=train)


def _warn_balance(good: int, bad: int, w_good: float, w_bad: float) -> None:
    """TRL's advice (the KTO paper's eq. 8): with unequal counts, ``w_d·n_d / (w_u·n_u)`` in ``[1, 4/3]``."""
    if good == bad or not good or not bad:
        if not good or not bad:
            logger.warning("KTO data has %d desirable and %d undesirable examples: one kind only", good, bad)
        return
    ratio = w_good * good / (w_bad * bad)
    if not 1 <= ratio <= 4 / 3:
        logger.warning(
            "KTO: %d desirable x desirable_weight %g / (%d undesirable x undesirable_weight %g) = %.2f, outside [1, "
            "4/3] (the KTO paper's eq. 8); e.g. desirable_weight %.2f, or undesirable_weight %.2f",
            good, w_good, bad, w_bad, ratio, bad * w_bad / good, good * w_good / bad,
        )  # fmt: skip


class KTOEvaluator:
    """KTO's evaluation: loss, KL, rewards per kind and margin over every eval example (every rank calls ``run``)."""

    def __init__(
        self, examples: Sequence[Any], reference: Reference, *, collator: Any, settings: KTOSettings, batch_size: int,
        device: torch.device,
    ) -> None:  # fmt: skip
        self.examples, self.reference, self.collator = examples, reference, collator
        self.settings, self.batch_size, self.device = settings, batch_size, device

    def run(
        self, model: torch.nn.Module, step: int, log: Callable[..., Any] | None = None
    ) -> dict[str, float]:
        out = evaluate_kto(
            model, self.reference, self.examples, collator=self.collator, batch_size=self.batch_size,
            settings=self.settings, device=self.device,
        )  # fmt: skip
        logger.info(
            "eval at step %d: loss %.4f, kl %.4f, margin %.4f (%d examples)", step, out["eval_loss"],
            out.get("eval_kl", 0.0), out.get("eval_rewards/margins", float("nan")), out["eval_examples"],
        )  # fmt: skip
        return out


def _build_kto(
    session: Session, model: TrainModel, optimizer: torch.optim.Optimizer, scheduler: Any, data: TrainData
) -> tuple[StepFn, Any]:
    cfg = session.cfg
    p, t = cfg.preference, cfg.train
    settings = KTOSettings(
        model.loss_plan, beta=float(p.beta or 0.1), loss_type=p.loss_type, desirable_weight=p.desirable_weight,
        undesirable_weight=p.undesirable_weight, max_grad_norm=t.max_grad_norm,
        sync_each_microbatch=cfg.fsdp.fsdp_sync_each_microbatch,
    )  # fmt: skip
    logger.info(
        "loss: %s, beta %g, desirable_weight %g, undesirable_weight %g, mean over the step's examples%s",
        "KTO" if settings.uses_kl else "APO-zero (unpaired)", p.beta, p.desirable_weight, p.undesirable_weight,
        "; KL reference point from each micro-batch's mismatched completions" if settings.uses_kl else "",
    )  # fmt: skip
    reference, eval_reference = build_reference(session, model, data, "KTO", "examples")

    def step(micro_batches: Sequence[dict[str, torch.Tensor]]) -> Any:
        return kto_step(
            model.module, optimizer, scheduler, micro_batches, reference, settings, session.device
        )

    evaluator = None
    if data.eval_set is not None:
        evaluator = KTOEvaluator(
            data.eval_set, eval_reference or reference, collator=data.collator, settings=settings,
            batch_size=cfg.observe.per_device_eval_batch_size or t.per_device_train_batch_size, device=session.device,
        )  # fmt: skip
    return step, evaluator


def kto_objective(cfg: Config) -> Objective:
    """The KTO objective (after :func:`kto_settings_check`); dropouts off with ``disable_dropout``."""
    kto_settings_check(cfg)
    return Objective(_build_kto, no_dropout=cfg.preference.disable_dropout)
