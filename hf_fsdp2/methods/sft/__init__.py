"""Supervised fine-tuning: ``data`` (chat / prompt-completion / text examples with loss masks, packed or padding-free
when asked) and the objective, token-level cross entropy over the step's target tokens (:mod:`hf_fsdp2.train.step`)."""

from __future__ import annotations

from typing import Any

import torch

from hf_fsdp2.config import Config
from hf_fsdp2.methods.sft.data import build_sft_data, preview_sft
from hf_fsdp2.train.step import Step, TokenLoss
from hf_fsdp2.trainer.data import TrainData
from hf_fsdp2.trainer.method import Method, Objective, loss_step
from hf_fsdp2.trainer.model import TrainModel
from hf_fsdp2.trainer.session import Session


def _build_sft(
    session: Session, model: TrainModel, optimizer: torch.optim.Optimizer, scheduler: Any, data: TrainData
) -> tuple[Step, Any]:
    step = loss_step(
        session, model, optimizer, scheduler, lambda: TokenLoss(model.loss_plan, session.device, model.module)
    )
    return step, None


SFT = Objective(_build_sft)
"""Token-level cross entropy on the target tokens (SFT and continued pre-training)."""


def sft_objective(cfg: Config) -> Objective:
    """The SFT objective (no keys of its own to check)."""
    return SFT


METHOD = Method(
    name="sft",
    title="supervised fine-tuning",
    build_data=build_sft_data,
    objective=sft_objective,
    preview_data=preview_sft,
    context_parallel=True,
    tensor_parallel=True,
    float8=True,  # tests/distributed/test_float8.py
)
