"""The KTO recipe's objective: the reference (as DPO builds it: the LoRA base, a precomputed table, or a frozen sharded
copy; :mod:`hf_fsdp2.run.reference`), the step and the evaluator (:mod:`hf_fsdp2.methods.kto.step`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hf_fsdp2.config import Config
from hf_fsdp2.config.plans import check
from hf_fsdp2.methods.kto.config import KtoArgs
from hf_fsdp2.methods.kto.step import KTOLoss, KTOSettings, evaluate_kto
from hf_fsdp2.run.build import TrainModel
from hf_fsdp2.run.data import TrainData
from hf_fsdp2.run.method import Objective, loss_step
from hf_fsdp2.run.reference import build_reference
from hf_fsdp2.run.session import Session
from hf_fsdp2.train.logps import Reference
from hf_fsdp2.train.loss import LossPlan
from hf_fsdp2.train.step import Step

logger = logging.getLogger("hf_fsdp2")


class KTOEvaluator:
    """KTO's evaluation: loss, KL, rewards per kind and margin over every eval example (every rank calls ``run``)."""

    def __init__(
        self,
        examples: Sequence[Any],
        reference: Reference,
        *,
        collator: Any,
        settings: KTOSettings,
        plan: LossPlan,
        batch_size: int,
        device: torch.device,
    ) -> None:
        self.examples, self.reference, self.collator = examples, reference, collator
        self.settings, self.plan, self.batch_size, self.device = settings, plan, batch_size, device

    def run(
        self, model: torch.nn.Module, step: int, log: Callable[..., Any] | None = None
    ) -> dict[str, float]:
        out = evaluate_kto(
            model,
            self.reference,
            self.examples,
            collator=self.collator,
            batch_size=self.batch_size,
            settings=self.settings,
            plan=self.plan,
            device=self.device,
        )
        logger.info(
            "eval at step %d: loss %.4f, kl %.4f, margin %.4f (%d examples)",
            step,
            out["eval_loss"],
            out.get("eval_kl", 0.0),
            out.get("eval_rewards/margins", float("nan")),
            out["eval_examples"],
        )
        return out


def _build_kto(
    session: Session, model: TrainModel, optimizer: torch.optim.Optimizer, scheduler: Any, data: TrainData
) -> tuple[Step, Any]:
    cfg = session.cfg
    p: KtoArgs = cfg.method
    t = cfg.train
    settings = KTOSettings(
        beta=p.beta,
        loss_type=p.loss_type,
        desirable_weight=p.desirable_weight,
        undesirable_weight=p.undesirable_weight,
    )
    logger.info(
        "loss: %s, beta %g, desirable_weight %g, undesirable_weight %g, mean over the step's examples%s",
        "KTO" if settings.uses_kl else "APO-zero (unpaired)",
        p.beta,
        p.desirable_weight,
        p.undesirable_weight,
        "; KL reference point from each micro-batch's mismatched completions" if settings.uses_kl else "",
    )
    reference, eval_reference = build_reference(session, model, data, p, "KTO", "examples")

    step = loss_step(
        session,
        model,
        optimizer,
        scheduler,
        lambda: KTOLoss(reference, settings, model.loss_plan, session.device),
    )
    evaluator = None
    if data.eval_set is not None:
        evaluator = KTOEvaluator(
            data.eval_set,
            eval_reference or reference,
            collator=data.collator,
            settings=settings,
            plan=model.loss_plan,
            batch_size=cfg.observe.per_device_eval_batch_size or t.per_device_train_batch_size,
            device=session.device,
        )
    return step, evaluator


def kto_objective(cfg: Config) -> Objective:
    """The KTO objective (its keys checked by :class:`KtoArgs`); dropouts off with ``disable_dropout``.

    Raises:
        ConfigError: ``loss_type: kto`` with a per-device batch of 1: its KL estimate would pair each prompt with
            its own completion (TRL refuses it too).
    """
    p: KtoArgs = cfg.method
    t = cfg.train
    check(
        p.loss_type != "kto" or t.per_device_train_batch_size > 1,
        f"per_device_train_batch_size={t.per_device_train_batch_size}: KTO estimates its KL reference point from each "
        "micro-batch's prompts paired with the other examples' completions, so it needs at least 2 examples per "
        "micro-batch (TRL refuses 1 too); raise it, or use loss_type apo_zero_unpaired (no KL term)",
    )
    return Objective(_build_kto, no_dropout=p.disable_dropout)
