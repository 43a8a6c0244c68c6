"""The reward-model recipe's data and objective: preference pairs as whole sequences (prompt + completion, chosen
rows then rejected rows, each pair's optional ``margin``), the model with a scalar score head, the Bradley-Terry step
and the evaluator (:mod:`hf_fsdp2.methods.rm.step`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hf_fsdp2.config import Config, ConfigError
from hf_fsdp2.config.plans import check
from hf_fsdp2.methods.rm.step import RewardLoss, RewardSettings, evaluate_rewards
from hf_fsdp2.run.build import TrainModel
from hf_fsdp2.run.data import TrainData, build_pair_data
from hf_fsdp2.run.method import Objective, composite_of, loss_step
from hf_fsdp2.run.session import Session
from hf_fsdp2.train.step import Step

logger = logging.getLogger("hf_fsdp2")


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
            model,
            self.pairs,
            collator=self.collator,
            batch_size=self.batch_size,
            settings=self.settings,
            device=self.device,
        )
        logger.info(
            "eval at step %d: loss %.4f, accuracy %.3f, margin %.4f (%d pairs)",
            step,
            out["eval_loss"],
            out["eval_accuracy"],
            out["eval_margin"],
            out["eval_pairs"],
        )
        return out


def _build_rm(
    session: Session, model: TrainModel, optimizer: torch.optim.Optimizer, scheduler: Any, data: TrainData
) -> tuple[Step, Any]:
    cfg = session.cfg
    t = cfg.train
    coef = cfg.method.center_rewards_coefficient
    settings = RewardSettings(center_rewards_coefficient=coef)
    logger.info(
        "loss: Bradley-Terry -logsigmoid(r_chosen - r_rejected - margin)%s, mean over the step's pairs",
        f" + {coef:g} x (r_chosen + r_rejected)^2" if coef else "",
    )

    step = loss_step(session, model, optimizer, scheduler, lambda: RewardLoss(settings, session.device))
    evaluator = None
    if data.eval_set is not None:
        evaluator = RewardEvaluator(
            data.eval_set,
            collator=data.collator,
            settings=settings,
            device=session.device,
            batch_size=cfg.observe.per_device_eval_batch_size or t.per_device_train_batch_size,
        )
    return step, evaluator


def build_rm_data(session: Session, tokenizer: Any) -> TrainData:
    """The preference pairs and micro-batches (each row prompt + completion; the reward reads the whole row)."""
    return build_pair_data(session, tokenizer, "reward-model")


def check_reward_composite(cfg: Config) -> None:
    """Refuse, before any loading, a composite checkpoint (vision tower + projector + language model) whose family
    has no sequence-classification class over the whole composite (:data:`~hf_fsdp2.composite.REWARD_CLASSES`:
    Gemma 3's and Qwen3.5's put the score head on the composite's language model and keep the tower, frozen and
    exported byte-identical; Llama 4, Mistral 3 and Qwen3.5 MoE have none, and the generic head of
    :mod:`hf_fsdp2.score_head` would sit on the family's AutoModel class, the composite itself or its text model
    alone).

    Raises:
        ConfigError: naming the architecture, why, and the fix.
    """
    import transformers

    from hf_fsdp2.composite import REWARD_CLASSES

    found = composite_of(cfg)
    if found is None:
        return
    spec, config = found
    if spec.architecture in REWARD_CLASSES.values():
        return
    raise ConfigError(
        f"reward modelling on {spec.architecture} (model_type {config.model_type!r}): transformers "
        f"{transformers.__version__} has no sequence-classification class for this composite, so no class would "
        "load it with a score head and keep its vision tower; train the reward model from the family's text-only "
        f"checkpoint, or from a composite that has one ({', '.join(sorted(REWARD_CLASSES.values()))})"
    )


def rm_objective(cfg: Config) -> Objective:
    """The reward-model objective: the model with a score head; dropouts off with ``disable_dropout``. A pair longer
    than ``max_length`` is dropped (this method's default ``long_examples: drop``, as TRL's RewardTrainer does) or,
    with ``long_examples: error``, refused.

    Raises:
        ConfigError: ``long_examples: truncate``, which would cut the end a reward is read at; a composite checkpoint
            transformers has no sequence-classification class for.
    """
    check_reward_composite(cfg)
    d = cfg.data
    check(
        d.long_examples != "truncate",
        "long_examples=truncate: a reward model reads each row's reward at its last token, which a cut row loses; "
        "use drop (this recipe's default, as TRL's RewardTrainer) or error",
    )
    if d.long_examples == "drop":
        logger.info(
            "reward model: pairs longer than max_length=%d are dropped (counted), as TRL does: a cut row "
            "loses the end its reward is read at",
            d.max_length,
        )
    return Objective(_build_rm, no_dropout=cfg.method.disable_dropout, reward_model=True)
