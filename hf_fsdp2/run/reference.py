"""The reference model of a preference objective (DPO, KTO; GRPO's KL term), built before any step or resume.

The reference is, in order of precedence:

* with LoRA: the policy with its adapter disabled (the base as loaded; no second copy);
* ``precompute_ref_log_probs``: every training (and eval) example's log-probs in one pass before training, by the
  policy itself as loaded (or ``ref_model_name_or_path``, loaded for the pass and freed): no reference in
  memory while training. On resume the pass runs again, before the checkpoint is loaded;
* otherwise a second model (``ref_model_name_or_path``, default the model being trained as loaded), frozen,
  sharded per decoder layer like the policy, in the compute dtype (bf16 under bf16 mixed precision), with no
  gradient and no optimizer state.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Sequence
from typing import Any

from hf_fsdp2 import collectives
from hf_fsdp2.config import Config
from hf_fsdp2.config.preference import ReferenceArgs
from hf_fsdp2.model import (
    decoder_layer_classes,
    disable_dropout,
    embedding_rows,
    fsdp_unit_classes,
    load_model,
    resize_embeddings,
)
from hf_fsdp2.parallel.parallelize import ContextParallel, ParallelPlan, parallelize
from hf_fsdp2.run.build import TrainModel, expert_plan
from hf_fsdp2.run.data import TrainData
from hf_fsdp2.run.session import Session
from hf_fsdp2.train.logps import (
    AdapterDisabled,
    FrozenModel,
    Precomputed,
    Reference,
    precompute_reference,
)
from hf_fsdp2.train.loss import LossPlan

logger = logging.getLogger("hf_fsdp2")


def reference_note(cfg: Config, name: str, free: str = "") -> list[str]:
    """The memory plan's line for a frozen reference copy it does not count (none with precompute, LoRA or
    ``free``): DPO's and KTO's."""
    p = cfg.method
    if p.precompute_ref_log_probs or cfg.peft.use_peft or getattr(p, "reference_free", False):
        return []
    return [
        f"not planned: {name}'s reference model (a frozen sharded copy of the policy, its gathered layers during "
        f"its forward); precompute_ref_log_probs: true, use_peft: true{free} trains without one"
    ]


def load_reference(
    session: Session,
    plan: LossPlan,
    tokenizer_size: int | None,
    ref_model_name_or_path: str | None,
    objective: str = "DPO",
) -> FrozenModel:
    """The frozen reference model, sharded like the policy (every rank; collective).

    Loaded in the compute dtype (bf16 under bf16 mixed precision, else ``torch_dtype``), every parameter frozen,
    every dropout off, then ``fully_shard`` per decoder layer on the run's mesh (rank 0's weights broadcast under
    ``fsdp_cpu_ram_efficient_loading``).
    """
    cfg = session.cfg
    m, f = cfg.model, cfg.fsdp
    path = ref_model_name_or_path or m.model_name_or_path or ""
    dtype = "bfloat16" if cfg.train.mixed_precision in ("bf16", "fp8") else m.torch_dtype
    model = load_model(
        path,
        dtype=dtype,
        attn_implementation=m.attn_implementation,
        revision=None if ref_model_name_or_path else m.model_revision,
        trust_remote_code=m.trust_remote_code,
        empty_weights=bool(f.fsdp_cpu_ram_efficient_loading) and session.rank != 0,
    )
    if tokenizer_size is not None:
        resize_embeddings(model, tokenizer_size)
    disable_dropout(model)
    model.requires_grad_(False)
    model.eval()
    # Sharded as the policy (the layers it wraps, context parallel: the same parts of the rows), never compiled or
    # checkpointed (no backward).
    cp = None
    if collectives.cp_size() > 1:
        cp = ContextParallel(
            collectives.cp_group(), collectives.cp_size(), f.cp_backend, collectives.tp_size()
        )
    layer_cls = decoder_layer_classes(model, f.fsdp_layer_cls_to_wrap)
    model = parallelize(
        model,
        session.accelerator,
        ParallelPlan(
            layer_cls=layer_cls,
            units=fsdp_unit_classes(model, layer_cls),
            cp=cp,
            ep=expert_plan(session, model),
            frozen=True,
        ),
    )
    logger.info(
        "%s reference: %s, frozen, sharded per decoder layer in %s (no optimizer state)",
        objective,
        path,
        dtype,
    )
    return FrozenModel(model, plan)


def build_reference(
    session: Session,
    model: TrainModel,
    data: TrainData,
    p: ReferenceArgs,
    objective: str = "DPO",
    unit: str = "pairs",
) -> tuple[Reference, Reference | None]:
    """The reference of the training and (when different: a precomputed table) of the eval examples (every rank;
    collective), in the order of precedence of the module's docstring; ``objective`` and ``unit`` name the
    objective and its examples in the log."""
    cfg = session.cfg
    t = cfg.train
    resized = embedding_rows(model.module.config) if cfg.model.resize_token_embeddings else None
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
        reference = load_reference(session, model.loss_plan, resized, p.ref_model_name_or_path, objective)
    if p.precompute_ref_log_probs:
        # The pass's reference: the LoRA base, a separate reference model, or the policy before any step.
        if cfg.peft.use_peft:
            source: Reference = reference
        elif p.ref_model_name_or_path:
            source = load_reference(session, model.loss_plan, resized, p.ref_model_name_or_path, objective)
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
            "training)",
            objective,
            len(train_pairs),
            f" and {len(eval_pairs)} eval" if eval_pairs is not None else "",
            unit,
        )
        del source
        gc.collect()
    return reference, eval_reference
