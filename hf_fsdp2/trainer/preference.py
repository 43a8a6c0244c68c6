"""The preference recipe's objective: the reference (built before any step or resume), the step, its evaluator.
SimPO and ORPO (``loss_type``) are reference-free: none of the references below is built for them.

The reference is, in order of precedence:

* with LoRA: the policy with its adapter disabled (the base as loaded; no second copy);
* ``precompute_ref_log_probs``: every training (and eval) pair's log-probs in one pass before training, by the
  policy itself as loaded (or ``ref_model_name_or_path``, loaded for the pass and freed): no reference in
  memory while training. On resume the pass runs again, before the checkpoint is loaded;
* otherwise a second model (``ref_model_name_or_path``, default the model being trained as loaded), frozen,
  sharded per decoder layer like the policy, in the compute dtype (bf16 under bf16 mixed precision), with no
  gradient and no optimizer state.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from accelerate.utils.fsdp_utils import fsdp2_prepare_model

from hf_fsdp2.config import Config
from hf_fsdp2.config.grpo import GRPO_LOSS_TYPES
from hf_fsdp2.config.plans import check
from hf_fsdp2.config.training import KTO_LOSS_TYPES
from hf_fsdp2.model import disable_dropout, load_model, resize_embeddings
from hf_fsdp2.train.dpo import (
    AdapterDisabled,
    DPOSettings,
    FrozenModel,
    Precomputed,
    Reference,
    dpo_step,
    evaluate_preferences,
    precompute_reference,
)
from hf_fsdp2.train.loss import LossPlan
from hf_fsdp2.trainer.model import TrainModel
from hf_fsdp2.trainer.objective import Objective, StepFn
from hf_fsdp2.trainer.session import Session
from hf_fsdp2.trainer.sft_data import TrainData

logger = logging.getLogger("hf_fsdp2")


def load_reference(
    session: Session, plan: LossPlan, tokenizer_size: int | None, objective: str = "DPO"
) -> FrozenModel:
    """The frozen reference model, sharded like the policy (every rank; collective).

    Loaded in the compute dtype (bf16 under bf16 mixed precision, else ``torch_dtype``), every parameter frozen,
    every dropout off, then ``fully_shard`` per decoder layer on the run's mesh (rank 0's weights broadcast under
    ``fsdp_cpu_ram_efficient_loading``).
    """
    cfg = session.cfg
    m, p, f = cfg.model, cfg.preference, cfg.fsdp
    path = p.ref_model_name_or_path or m.model_name_or_path or ""
    dtype = "bfloat16" if cfg.train.mixed_precision == "bf16" else m.torch_dtype
    model = load_model(
        path,
        dtype=dtype,
        attn_implementation=m.attn_implementation,
        revision=None if p.ref_model_name_or_path else m.model_revision,
        trust_remote_code=m.trust_remote_code,
        empty_weights=bool(f.fsdp_cpu_ram_efficient_loading) and session.rank != 0,
    )
    if tokenizer_size is not None:
        resize_embeddings(model, tokenizer_size)
    disable_dropout(model)
    model.requires_grad_(False)
    model.eval()
    model = fsdp2_prepare_model(session.accelerator, model)
    logger.info(
        "%s reference: %s, frozen, sharded per decoder layer in %s (no optimizer state)",
        objective,
        path,
        dtype,
    )
    return FrozenModel(model, plan)


def build_reference(
    session: Session, model: TrainModel, data: TrainData, objective: str = "DPO", unit: str = "pairs"
) -> tuple[Reference, Reference | None]:
    """The reference of the training and (when different: a precomputed table) of the eval examples (every rank;
    collective), in the order of precedence of the module's docstring; ``objective`` and ``unit`` name the
    objective and its examples in the log."""
    cfg = session.cfg
    p, t = cfg.preference, cfg.train
    resized = getattr(model.module.config, "vocab_size", None) if cfg.model.resize_token_embeddings else None
    train_pairs, eval_pairs = data.train_set, data.eval_set
    reference: Reference
    eval_reference: Reference | None = None
    if cfg.peft.use_peft:
        if p.ref_model_name_or_path:
            logger.warning(
                "ref_model_name_or_path is ignored with LoRA: the reference is the adapter-free base"
            )
        reference = AdapterDisabled(model.module, model.loss_plan)
        logger.info("%s reference: the base model with the LoRA adapter disabled (no second copy)", objective)
    elif not p.precompute_ref_log_probs:
        reference = load_reference(session, model.loss_plan, resized, objective)
    if p.precompute_ref_log_probs:
        # The pass's reference: the LoRA base, a separate reference model, or the policy before any step.
        if cfg.peft.use_peft:
            source: Reference = reference
        elif p.ref_model_name_or_path:
            source = load_reference(session, model.loss_plan, resized, objective)
        else:
            source = FrozenModel(model.module, model.loss_plan)
        batch_size = p.precompute_ref_batch_size or t.per_device_train_batch_size

        def table(pairs: Sequence[Any]) -> Precomputed:
            return precompute_reference(
                source, pairs, collator=data.collator, batch_size=batch_size, device=session.device
            )

        reference = table(train_pairs)
        if eval_pairs is not None:
            eval_reference = table(eval_pairs)
        logger.info(
            "%s reference: log-probs of %d training%s %s precomputed in one pass (no reference model while "
            "training)", objective, len(train_pairs), f" and {len(eval_pairs)} eval" if eval_pairs is not None else "", unit,
        )  # fmt: skip
        del source
        gc.collect()
    return reference, eval_reference


def _build_dpo(
    session: Session, model: TrainModel, optimizer: torch.optim.Optimizer, scheduler: Any, data: TrainData
) -> tuple[StepFn, Any]:
    cfg = session.cfg
    p, t = cfg.preference, cfg.train
    settings = DPOSettings(
        model.loss_plan, beta=float(p.beta or 0.1), loss_type=p.loss_type, label_smoothing=p.label_smoothing,
        simpo_gamma=p.simpo_gamma, cpo_alpha=p.cpo_alpha, max_grad_norm=t.max_grad_norm,
        sync_each_microbatch=cfg.fsdp.fsdp_sync_each_microbatch,
    )  # fmt: skip
    if settings.reference_free:
        return _reference_free(session, model, optimizer, scheduler, data, settings)
    if p.loss_type == "sigmoid" and p.label_smoothing > 0:
        logger.info(
            "loss: conservative DPO, label_smoothing=%g (TRL 1.16's sigmoid loss ignores label_smoothing)",
            p.label_smoothing,
        )
    logger.info("loss: DPO %s, beta %g, mean over the step's pairs", p.loss_type, p.beta)
    reference, eval_reference = build_reference(session, model, data)

    def step(micro_batches: Sequence[dict[str, torch.Tensor]]) -> Any:
        return dpo_step(
            model.module, optimizer, scheduler, micro_batches, reference, settings, session.device
        )

    evaluator = None
    if data.eval_set is not None:
        evaluator = PreferenceEvaluator(
            data.eval_set, eval_reference or reference, collator=data.collator, settings=settings,
            batch_size=cfg.observe.per_device_eval_batch_size or t.per_device_train_batch_size,
            device=session.device,
        )  # fmt: skip
    return step, evaluator


def _reference_free(
    session: Session, model: TrainModel, optimizer: torch.optim.Optimizer, scheduler: Any, data: TrainData,
    settings: DPOSettings,
) -> tuple[StepFn, Any]:  # fmt: skip
    """SimPO and ORPO: the policy alone, no reference model or pass (the same on every rank: the run's objective)."""
    p = session.cfg.preference
    if settings.loss_type == "simpo":
        logger.info("loss: SimPO, beta %g, gamma %g%s, mean over the step's pairs (reference-free)", p.beta,
                    p.simpo_gamma, f", + {p.cpo_alpha:g} x NLL of the chosen completions" if p.cpo_alpha else "")  # fmt: skip
    else:
        logger.info("loss: ORPO, NLL of the chosen sequences, prompt and completion (mean over their tokens) + %g x odds-ratio term (mean "
                    "over the step's pairs); reference-free", p.beta)  # fmt: skip

    def step(micro_batches: Sequence[dict[str, torch.Tensor]]) -> Any:
        return dpo_step(model.module, optimizer, scheduler, micro_batches, None, settings, session.device)

    evaluator = None
    if data.eval_set is not None:
        t = session.cfg.train
        evaluator = PreferenceEvaluator(
            data.eval_set, None, collator=data.collator, settings=settings,
            batch_size=session.cfg.observe.per_device_eval_batch_size or t.per_device_train_batch_size,
            device=session.device,
        )  # fmt: skip
    return step, evaluator


class PreferenceEvaluator:
    """DPO's evaluation: loss, rewards, accuracy and margins over every eval pair (every rank calls ``run``)."""

    def __init__(
        self, pairs: Sequence[Any], reference: Reference | None, *, collator: Any, settings: DPOSettings, batch_size: int,
        device: torch.device,
    ) -> None:  # fmt: skip
        self.pairs, self.reference, self.collator = pairs, reference, collator
        self.settings, self.batch_size, self.device = settings, batch_size, device

    def run(
        self, model: torch.nn.Module, step: int, log: Callable[..., Any] | None = None
    ) -> dict[str, float]:
        out = evaluate_preferences(
            model, self.reference, self.pairs, collator=self.collator, batch_size=self.batch_size,
            settings=self.settings, device=self.device,
        )  # fmt: skip
        logger.info(
            "eval at step %d: loss %.4f, accuracy %.3f, margin %.4f (%d pairs)",
            step, out["eval_loss"], out["eval_rewards/accuracies"], out["eval_rewards/margins"], out["eval_pairs"],
        )  # fmt: skip
        return out


def dpo_objective(cfg: Config) -> Objective:
    """The DPO objective (SimPO, ORPO: ``loss_type``); the policy's dropouts set to 0 before sharding with
    ``disable_dropout``.

    Raises:
        ConfigError: a KTO setting, which this recipe does not train (every rank alike, before any loading).
    """
    p = cfg.preference
    if p.beta is None:
        p.beta = 0.1  # TRL's DPOConfig default
    check(p.beta > 0, f"beta={p.beta} must be > 0 for DPO, SimPO and ORPO")
    check(
        p.loss_type not in GRPO_LOSS_TYPES,
        f"loss_type={p.loss_type!r} is a GRPO loss: run recipes/grpo.py (hf-fsdp2 train grpo)",
    )
    check(
        p.loss_type not in KTO_LOSS_TYPES,
        f"loss_type={p.loss_type!r} trains on unpaired (prompt, completion, label) data: run recipes/kto.py "
        "(hf-fsdp2 train kto), or pick a DPO loss_type",
    )
    weights = [
        f"{k}={getattr(p, k)}" for k in ("desirable_weight", "undesirable_weight") if getattr(p, k) != 1
    ]
    check(
        not weights, f"{', '.join(weights)}: KTO settings (recipes/kto.py); the DPO recipe would ignore them"
    )
    return Objective(_build_dpo, no_dropout=p.disable_dropout)
