"""The reward-model recipe's data and objective: preference pairs as whole sequences (prompt + completion, chosen
rows then rejected rows, each pair's optional ``margin``), the model with a scalar score head, the Bradley-Terry step
and the evaluator (:mod:`hf_fsdp2.train.reward`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hf_fsdp2.config import Config
from hf_fsdp2.config.plans import check
from hf_fsdp2.train.reward import RewardSettings, evaluate_rewards, reward_step
from hf_fsdp2.trainer.dpo_data import build_dpo_data
from hf_fsdp2.trainer.model import TrainModel
from hf_fsdp2.trainer.objective import Objective, StepFn
from hf_fsdp2.trainer.session import Session
from hf_fsdp2.trainer.sft_data import TrainData

logger = logging.getLogger("hf_fsdp2")

_PREFERENCE_ONLY = (
    "beta",
    "label_smoothing",
    "cpo_alpha",
    "precompute_ref_log_probs",
    "ref_model_name_or_path",
)


def rm_settings_check(cfg: Config) -> None:
    """The reward recipe's reading of the config (every rank alike, before any loading): a pair longer than
    ``max_length`` is dropped, as TRL's RewardTrainer does (truncating it would cut the end whose last token the
    reward is read at), unless ``long_examples: error``; a preference-objective key is refused.

    Raises:
        ConfigError: naming the key and the fix.
    """
    d, p = cfg.data, cfg.preference
    defaults = type(p)()
    changed = [k for k in _PREFERENCE_ONLY if getattr(p, k) != getattr(defaults, k)]
    check(
        not changed and p.loss_type == defaults.loss_type,
        f"{', '.join(changed) or f'loss_type={p.loss_type!r}'}: a preference-optimisation setting (recipes/dpo.py, "
        "recipes/kto.py); a reward model is trained with the Bradley-Terry loss alone: unset it",
    )
    if d.long_examples == "truncate":
        d.long_examples = "drop"
        logger.info("reward model: pairs longer than max_length=%d are dropped (counted), as TRL does: a cut row "
                    "loses the end its reward is read at", d.max_length)  # fmt: skip


class RewardEvaluator:
    """The reward model's evaluation over every eval pair (every rank calls ``run``)."""

    def __init__(
        self,
        pairs: Sequence[Any],
        *,
        collator: Any,
        settings: RewardSettings,
        batch_size: int,
        device: torch.device,
    ) -> None:
        self.pairs, self.collator, self.settings = pairs, collator, settings
        self.batch_size, self.device = batch_size, device

    def run(
        self, model: torch.nn.Module, step: int, log: Callable[..., Any] | None = None
    ) -> dict[str, float]:
        out = evaluate_rewards(
            model, self.pairs, collator=self.collator, batch_size=self.batch_size, settings=self.settings,
            device=self.device,
        )  # fmt: skip
        logger.info(
            "eval at step %d: loss %.4f, accuracy %.3f, margin %.4f (%d pairs)",
            step, out["eval_loss"], out["eval_accuracy"], out["eval_margin"], out["eval_pairs"],
        )  # fmt: skip
        return out


def _build_rm(
    session: Session, model: TrainModel, optimizer: torch.optim.Optimizer, scheduler: Any, data: TrainData
) -> tuple[StepFn, Any]:
    cfg = session.cfg
    t = cfg.train
    coef = cfg.preference.center_rewards_coefficient
    settings = RewardSettings(model.loss_plan, center_rewards_coefficient=coef, max_grad_norm=t.max_grad_norm,
                              sync_each_microbatch=cfg.fsdp.fsdp_sync_each_microbatch)  # fmt: skip
    logger.info(
        "loss: Bradley-Terry -logsigmoid(r_chosen - r_rejected - margin)%s, mean over the step's pairs",
        f" + {coef:g} x (r_chosen + r_rejected)^2" if coef else "",
    )

    def step(micro_batches: Sequence[dict[str, torch.Tensor]]) -> Any:
        return reward_step(model.module, optimizer, scheduler, micro_batches, settings, session.device)

    evaluator = None
    if data.eval_set is not None:
        evaluator = RewardEvaluator(
            data.eval_set, collator=data.collator, settings=settings, device=session.device,
            batch_size=cfg.observe.per_device_eval_batch_size or t.per_device_train_batch_size,
        )  # fmt: skip
    return step, evaluator


def build_rm_data(session: Session, tokenizer: Any) -> TrainData:
    """The DPO recipe's pairs and micro-batches (each row prompt + completion; the reward reads the whole row)."""
    return build_dpo_data(session, tokenizer, "reward-model")


def rm_objective(cfg: Config) -> Objective:
    """The reward-model objective (after :func:`rm_settings_check`): the model with a score head."""
    rm_settings_check(cfg)
    return Objective(_build_rm, no_dropout=cfg.preference.disable_dropout, reward_model=True)
