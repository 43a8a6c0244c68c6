"""The DPO recipe's objective: the reference (:mod:`hf_fsdp2.run.reference`, built before any step or resume),
the step, its evaluator. SimPO and ORPO (``loss_type``) are reference-free: no reference is built for them."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hf_fsdp2.config import Config
from hf_fsdp2.methods.dpo.config import DpoArgs
from hf_fsdp2.methods.dpo.step import DPOLoss, DPOSettings, evaluate_preferences
from hf_fsdp2.run.build import TrainModel
from hf_fsdp2.run.data import TrainData
from hf_fsdp2.run.method import Objective, loss_step
from hf_fsdp2.run.reference import build_reference
from hf_fsdp2.run.session import Session
from hf_fsdp2.train.logps import Reference
from hf_fsdp2.train.loss import LossPlan
from hf_fsdp2.train.step import Step

logger = logging.getLogger("hf_fsdp2")


def _build_dpo(
    session: Session, model: TrainModel, optimizer: torch.optim.Optimizer, scheduler: Any, data: TrainData
) -> tuple[Step, Any]:
    cfg = session.cfg
    p: DpoArgs = cfg.method
    t = cfg.train
    settings = DPOSettings(
        beta=p.beta,
        loss_type=p.loss_type,
        label_smoothing=p.label_smoothing,
        simpo_gamma=p.simpo_gamma,
        cpo_alpha=p.cpo_alpha,
    )
    if settings.reference_free:
        return _reference_free(session, model, optimizer, scheduler, data, settings)
    if p.loss_type == "sigmoid" and p.label_smoothing > 0:
        logger.info(
            "loss: conservative DPO, label_smoothing=%g (TRL 1.16's sigmoid loss ignores label_smoothing)",
            p.label_smoothing,
        )
    logger.info("loss: DPO %s, beta %g, mean over the step's pairs", p.loss_type, p.beta)
    reference, eval_reference = build_reference(session, model, data, p)

    step = loss_step(
        session,
        model,
        optimizer,
        scheduler,
        lambda: DPOLoss(reference, settings, model.loss_plan, session.device),
    )
    evaluator = None
    if data.eval_set is not None:
        evaluator = PreferenceEvaluator(
            data.eval_set,
            eval_reference or reference,
            collator=data.collator,
            settings=settings,
            plan=model.loss_plan,
            batch_size=cfg.observe.per_device_eval_batch_size or t.per_device_train_batch_size,
            device=session.device,
        )
    return step, evaluator


def _reference_free(
    session: Session,
    model: TrainModel,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    data: TrainData,
    settings: DPOSettings,
) -> tuple[Step, Any]:
    """SimPO and ORPO: the policy alone, no reference model or pass (the same on every rank: the run's objective)."""
    p: DpoArgs = session.cfg.method
    if settings.loss_type == "simpo":
        logger.info(
            "loss: SimPO, beta %g, gamma %g%s, mean over the step's pairs (reference-free)",
            p.beta,
            p.simpo_gamma,
            f", + {p.cpo_alpha:g} x NLL of the chosen completions" if p.cpo_alpha else "",
        )
    else:
        logger.info(
            "loss: ORPO, NLL of the chosen sequences, prompt and completion (mean over their tokens) + %g x odds-ratio term (mean "
            "over the step's pairs); reference-free",
            p.beta,
        )

    step = loss_step(
        session, model, optimizer, scheduler, lambda: DPOLoss(None, settings, model.loss_plan, session.device)
    )
    evaluator = None
    if data.eval_set is not None:
        t = session.cfg.train
        evaluator = PreferenceEvaluator(
            data.eval_set,
            None,
            collator=data.collator,
            settings=settings,
            plan=model.loss_plan,
            batch_size=session.cfg.observe.per_device_eval_batch_size or t.per_device_train_batch_size,
            device=session.device,
        )
    return step, evaluator


class PreferenceEvaluator:
    """DPO's evaluation: loss, rewards, accuracy and margins over every eval pair (every rank calls ``run``)."""

    def __init__(
        self,
        pairs: Sequence[Any],
        reference: Reference | None,
        *,
        collator: Any,
        settings: DPOSettings,
        plan: LossPlan,
        batch_size: int,
        device: torch.device,
    ) -> None:
        self.pairs, self.reference, self.collator = pairs, reference, collator
        self.settings, self.plan, self.batch_size, self.device = settings, plan, batch_size, device

    def run(
        self, model: torch.nn.Module, step: int, log: Callable[..., Any] | None = None
    ) -> dict[str, float]:
        out = evaluate_preferences(
            model,
            self.reference,
            self.pairs,
            collator=self.collator,
            batch_size=self.batch_size,
            settings=self.settings,
            plan=self.plan,
            device=self.device,
        )
        logger.info(
            "eval at step %d: loss %.4f, accuracy %.3f, margin %.4f (%d pairs)",
            step,
            out["eval_loss"],
            out["eval_rewards/accuracies"],
            out["eval_rewards/margins"],
            out["eval_pairs"],
        )
        return out


def dpo_objective(cfg: Config) -> Objective:
    """The DPO objective (SimPO, ORPO: ``loss_type``; its keys checked by :class:`DpoArgs`); the policy's dropouts set
    to 0 before sharding with ``disable_dropout``."""
    p: DpoArgs = cfg.method
    return Objective(_build_dpo, no_dropout=p.disable_dropout)
