"""What a recipe optimises: given the run's model, optimizer, schedule and data, the function that takes one
optimizer step over a rank's micro-batches (and, when the recipe evaluates differently from SFT, its evaluator).

The loop, checkpoints, metrics and export are shared (``run`` in recipes/sft.py); a recipe differs by its data
and its objective. Every step function returns what the observer logs: ``loss_sum`` / ``loss_count`` (the loss),
``target_tokens``, ``processed_tokens``, ``grad_norm``, ``lr`` and ``extra_metrics`` (collective).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hf_fsdp2.train.step import StepSettings, train_step
from hf_fsdp2.trainer.model import TrainModel
from hf_fsdp2.trainer.session import Session
from hf_fsdp2.trainer.sft_data import TrainData

StepFn = Callable[[Sequence[dict[str, torch.Tensor]]], Any]


@dataclass(frozen=True)
class Objective:
    """A recipe's objective.

    Attributes:
        build: ``(session, model, optimizer, scheduler, data) -> (step function, evaluator or None)``; called by
            every rank once the model is sharded and before a checkpoint is resumed (the weights are still the
            loaded ones). An evaluator has ``run(model, step, log) -> metrics``; None: the SFT evaluator on
            ``data.eval_set``.
        no_dropout: every dropout of the model set to 0 before sharding.
        reward_model: the model is loaded with a scalar score head (``AutoModelForSequenceClassification``).
    """

    build: Callable[[Session, TrainModel, torch.optim.Optimizer, Any, TrainData], tuple[StepFn, Any]]
    no_dropout: bool = False
    reward_model: bool = False


def _build_sft(
    session: Session, model: TrainModel, optimizer: torch.optim.Optimizer, scheduler: Any, data: TrainData
) -> tuple[StepFn, Any]:
    cfg = session.cfg
    settings = StepSettings(model.loss_plan, cfg.train.max_grad_norm, cfg.fsdp.fsdp_sync_each_microbatch)

    def step(micro_batches: Sequence[dict[str, torch.Tensor]]) -> Any:
        return train_step(model.module, optimizer, scheduler, micro_batches, settings, session.device)

    return step, None


SFT = Objective(_build_sft)
"""Token-level cross entropy on the target tokens (SFT and continued pre-training)."""
