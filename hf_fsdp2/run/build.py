"""The model of a run: tokenizer, weights, LoRA, FSDP2 sharding per decoder layer, the optimizer and schedule,
and the loss plan, all from the config sections. Every refusal here happens before the first step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from hf_fsdp2 import collectives
from hf_fsdp2.attention_layout import check_loaded_attention, choose_attention_layout
from hf_fsdp2.composite import composite_spec, describe_parts, freeze_parts, vision_parameters
from hf_fsdp2.config import ConfigError
from hf_fsdp2.config.float8 import Float8Plan
from hf_fsdp2.export.errors import ExportError
from hf_fsdp2.export.plan import check_whole_export
from hf_fsdp2.export.source import ExportSource
from hf_fsdp2.lora.adapter import apply_lora, format_memory_report, memory_report
from hf_fsdp2.lora.merge import check_mergeable
from hf_fsdp2.lora.quantize import QuantizationError, local_nf4_bytes, quantize_base
from hf_fsdp2.model import (
    check_vocab,
    count_parameters,
    decoder_layer_classes,
    disable_dropout,
    fsdp_unit_classes,
    load_model,
    load_tokenizer,
    resize_embeddings,
)
from hf_fsdp2.observe.flops import FlopsModel, active_non_embedding_params, flops_model, peak_flops_for
from hf_fsdp2.parallel.accelerator import describe_layout, launcher_mesh, sharded_units
from hf_fsdp2.parallel.all_to_all import ContextParallelError
from hf_fsdp2.parallel.expert_shard import expert_meshes
from hf_fsdp2.parallel.experts import check_expert_split, find_experts, read_experts
from hf_fsdp2.parallel.float8 import check_float8_hardware, finish_float8, warn_without_compile
from hf_fsdp2.parallel.grouped_mm import model_experts_kernel
from hf_fsdp2.parallel.kernels import apply_liger_kernels
from hf_fsdp2.parallel.parallelize import (
    ContextParallel,
    ExpertParallel,
    ParallelPlan,
    TensorParallel,
    parallelize,
)
from hf_fsdp2.parallel.tensor import TensorParallelError, tp_plan_for
from hf_fsdp2.run.session import Session
from hf_fsdp2.train.loss import LossPlan, plan_loss, router_aux_coef
from hf_fsdp2.train.muon import MuonSettings, build_muon_adamw
from hf_fsdp2.train.optim import build_adamw, build_scheduler, param_groups, warmup_steps_for

logger = logging.getLogger("hf_fsdp2")


def load_run_tokenizer(session: Session) -> Any:
    """The run's tokenizer, refused before any work when it has more tokens than the model's embedding
    (unless ``resize_token_embeddings``)."""
    m = session.cfg.model
    tokenizer = load_tokenizer(
        m.tokenizer_name_or_path or m.model_name_or_path or "",
        revision=m.model_revision,
        trust_remote_code=m.trust_remote_code,
    )
    check_vocab(len(tokenizer), session.model_config, resize=m.resize_token_embeddings)
    return tokenizer


@dataclass(kw_only=True)
class TrainModel:
    """The sharded model and what the loop needs to know about it."""

    module: torch.nn.Module
    layer_cls: tuple[str, ...]
    loss_plan: LossPlan
    flops: FlopsModel
    peak_flops: float | None


def build_model(
    session: Session, tokenizer: Any, *, no_dropout: bool = False, reward: bool = False
) -> tuple[TrainModel, torch.optim.Optimizer]:
    """The run's model, in the order torchtitan builds one: load -> adapters (QLoRA, LoRA, Liger) ->
    :func:`~hf_fsdp2.parallel.parallelize.parallelize` (float8 -> TP -> CP -> AC -> compile -> FSDP2) -> the optimizer
    on the sharded parameters (and FP8's post-step hook) -> the loss plan.

    Every rank takes part (sharding, the loss probe). ``no_dropout``: every dropout set to 0 (LoRA's too).
    ``reward``: the model with a scalar score head (``AutoModelForSequenceClassification``, one label; a head the
    checkpoint lacks is initialised from ``seed``, the same on every rank) and no LM loss plan.

    Returns:
        The sharded model and its optimizer.

    Raises:
        ConfigError / ExportError / LoraError: a model the run cannot train or export, before any step.
    """
    cfg = session.cfg
    t, f = cfg.train, cfg.fsdp
    fp8 = t.float8_plan() if t.mixed_precision == "fp8" else None
    if fp8 is not None:  # no FP8 hardware: refused (unless emulated) before any weight is read
        for line in filter(
            None,
            (check_float8_hardware(fp8, session.device), warn_without_compile(session.compile_plan.enabled)),
        ):
            logger.warning("%s", line)
    model = load_run_model(session, tokenizer, reward=reward)
    freeze_composite(session, model)
    model, quant = add_adapters(session, model, reward=reward, no_dropout=no_dropout)
    layer_cls = decoder_layer_classes(model, f.fsdp_layer_cls_to_wrap)
    n_total, n_trainable = count_parameters(model)
    logger.info(
        "model %s: %.1fM parameters (%.1fM trainable)", type(model).__name__, n_total / 1e6, n_trainable / 1e6
    )
    flops, peak = _flops_and_peak(session, model)
    log_experts_kernel(session, model)
    try:
        model = parallelize(model, session.accelerator, parallel_plan(session, model, layer_cls, fp8))
    except (
        ContextParallelError,
        TensorParallelError,
    ) as err:  # a layout the model cannot take: the user's fix
        raise ConfigError(str(err)) from err
    optimizer = build_optimizer(session, model, layer_cls)
    if fp8 is not None:
        logger.info("%s", finish_float8(model, optimizer, fp8, session.device))
    for name, (units, params) in sharded_units(model).items():
        logger.info("FSDP units: %d x %s (%.2fM parameters)", units, name, params / 1e6)
    if quant is not None:
        held = local_nf4_bytes(model)
        logger.info(
            "4-bit base on this rank after sharding: %.3f MiB (%d bytes) of %d bytes in all (rank %d of %d)",
            held / 2**20,
            held,
            quant.nf4_bytes,
            session.rank,
            session.world,
        )
    logger.info("parameter layout: %s", describe_layout(model))
    loss_plan = run_loss_plan(model, t.ce_chunk_tokens, reward=reward)
    plan, compile_plan = session.sharding, session.compile_plan
    logger.info(
        "activation checkpointing %s%s; torch.compile %s",
        plan.ac.mode,
        f" (k={plan.ac.every_k})" if plan.ac.mode == "every_k" else "",
        f"{compile_plan.scope} (compile time reported apart from step time, as compile_s)"
        if compile_plan.enabled
        else "off",
    )
    return TrainModel(
        module=model, layer_cls=layer_cls, loss_plan=loss_plan, flops=flops, peak_flops=peak
    ), optimizer


def load_run_model(session: Session, tokenizer: Any, *, reward: bool) -> torch.nn.Module:
    """The run's model as loaded (rank 0's weights; the other ranks build it on meta under rank-0 loading), with
    its score head (``reward``), its embedding resized to the tokenizer where asked, and the export's checkpoint
    layout and the packed-attention kernel checked now: a run the export or the batches cannot serve is refused
    before training, not after it."""
    cfg = session.cfg
    m, d, t, f = cfg.model, cfg.data, cfg.train, cfg.fsdp
    # The kernel of the layout the data builder chose (the same decision; its flex/flash refusals come before
    # any weight is read, for DPO too). padding_free is resolved by now: no probe, nothing logged twice.
    attention = choose_attention_layout(
        session.model_config,
        device_type=session.device.type,
        attn_implementation=m.attn_implementation,
        packing=d.packing,
        padding_free=bool(d.padding_free),
        trust_remote_code=m.trust_remote_code,
    )
    with torch.random.fork_rng(devices=[]) if reward else contextlib.nullcontext():
        if (
            reward
        ):  # a score head the checkpoint lacks: seeded (as TRL seeds it), the same values on every rank
            torch.manual_seed(t.seed)
        model = load_model(
            m.model_name_or_path or "",
            dtype=m.torch_dtype,
            attn_implementation=attention.attn_implementation,
            revision=m.model_revision,
            trust_remote_code=m.trust_remote_code,
            # Rank-0-only loading: the other ranks build the model on meta and receive their shards in parallelize.
            empty_weights=bool(f.fsdp_cpu_ram_efficient_loading) and session.rank != 0,
            reward_head=tokenizer.pad_token_id if reward else None,
        )
    if reward:
        head = getattr(model, "score", None)
        logger.info(
            "reward model %s: score head %s, read at each row's last non-padding token (pad id %s)",
            type(model).__name__,
            tuple(head.weight.shape) if head is not None else "?",
            model.config.pad_token_id,  # type: ignore[union-attr]
        )
    note = check_vocab(len(tokenizer), session.model_config, resize=m.resize_token_embeddings)
    if note:
        logger.info(note)
        resize_embeddings(model, len(tokenizer))
    # The export's checkpoint layout (names, per-expert splits of fused MoE tensors) and what it carries from the
    # checkpoint's files, planned now: a format the export cannot write, or a checkpoint tensor it would lack, is
    # refused before training, not after it (every rank: the same files, the same answer).
    source = ExportSource(m.model_name_or_path or "", m.model_revision)
    layout, carried = collectives.run_on_all(
        "planning the export", lambda: check_whole_export(model, source), ExportError
    )
    if carried is not None and (carried.unloaded or carried.left_out):
        logger.info("%s", carried.summary(None))
    if layout.splits:
        logger.info(
            "export: %d fused expert tensors will be written per expert, as transformers saves them",
            len(layout.splits),
        )
    attn = getattr(model.config, "_attn_implementation", None)
    logger.info(
        "attention implementation %s%s",
        attn,
        " (chosen by transformers)" if m.attn_implementation == "auto" else "",
    )
    check_loaded_attention(
        attn,
        asked=m.attn_implementation,
        packing=bool(d.packing),
        padding_free=bool(d.padding_free),
        model_cls=type(model),
    )
    return model


def freeze_composite(session: Session, model: torch.nn.Module) -> None:
    """A composite checkpoint's vision tower and projector frozen (``freeze_vision_tower``,
    ``freeze_multi_modal_projector``; :func:`~hf_fsdp2.composite.freeze_parts`), before the adapters wrap the model:
    they take no gradient and no optimizer state. Every rank alike; a text model is left as it is."""
    m = session.cfg.model
    spec = composite_spec(model.config)
    if spec is None:
        return
    freeze_parts(
        model,
        spec,
        freeze_vision_tower=m.freeze_vision_tower,
        freeze_multi_modal_projector=m.freeze_multi_modal_projector,
    )
    logger.info(
        "%s (freeze_vision_tower=%s, freeze_multi_modal_projector=%s)",
        describe_parts(model, spec),
        str(m.freeze_vision_tower).lower(),
        str(m.freeze_multi_modal_projector).lower(),
    )


def add_adapters(
    session: Session, model: torch.nn.Module, *, reward: bool, no_dropout: bool
) -> tuple[torch.nn.Module, Any]:
    """QLoRA's NF4 base, the LoRA adapter, dropout off, Liger's kernels: what wraps or swaps the loaded model's
    modules before it is parallelized.

    Returns:
        The model and QLoRA's quantization report (None without ``load_in_4bit``).
    """
    cfg = session.cfg
    f, t = cfg.fsdp, cfg.train
    quant = None
    if cfg.peft.load_in_4bit:  # QLoRA: the decoder layers' linear weights in NF4, before LoRA wraps them
        try:
            quant = quantize_base(
                model,
                decoder_layer_classes(model, f.fsdp_layer_cls_to_wrap),
                shards=session.world,
                skip=tuple(cfg.peft.lora_modules_to_save),
            )
        except QuantizationError as err:
            raise ConfigError(str(err)) from err
        logger.info(quant.describe(session.world))
    if cfg.peft.use_peft:  # LoRA: the base frozen as loaded, the adapter in fp32; wrapped before sharding
        settings = cfg.peft.lora_settings()
        if reward:  # PEFT trains the score head in full (modules_to_save)
            settings = dataclasses.replace(settings, task_type="SEQ_CLS")
        model = apply_lora(model, settings, seed=t.seed)
        if cfg.peft.merge_adapter:  # what the merged export cannot merge is refused now, not after training
            check_mergeable(model)
        logger.info(format_memory_report(memory_report(model), session.world))
    if no_dropout:
        logger.info("dropout disabled: %d non-zero dropout rates set to 0", disable_dropout(model))
    if t.use_liger_kernel:
        apply_liger_kernels(model)
        logger.info("Liger kernels: RMSNorm, SwiGLU and rotary embeddings (loss: chunked cross entropy)")
    return model, quant


def log_experts_kernel(session: Session, model: torch.nn.Module) -> None:
    """Name the kernel a mixture of experts runs its routed experts with; a warning with the reason and the fix when
    transformers falls back to its per-expert loop (:mod:`hf_fsdp2.parallel.grouped_mm`)."""
    found = model_experts_kernel(
        model,
        compiled=session.compile_plan.enabled,
        compute_dtype=session.compute_dtype,
        device=session.device,
    )
    if found is None:
        return
    kernel, line = found
    if kernel.reason is None:
        logger.info("%s", line)
    else:
        logger.warning("%s", line)


def parallel_plan(
    session: Session, model: torch.nn.Module, layer_cls: tuple[str, ...], fp8: Float8Plan | None
) -> ParallelPlan:
    """The run's :class:`~hf_fsdp2.parallel.parallelize.ParallelPlan` from its config and mesh; what a layout cannot
    take is refused here, before any step.

    Raises:
        ConfigError: a family without a tensor-parallel plan, or context parallel with a MoE router loss.
    """
    tp = cp = None
    if collectives.tp_size() > 1:
        try:
            tp = TensorParallel(session.accelerator.torch_device_mesh["tp"], tp_plan_for(model))
        except TensorParallelError as err:
            raise ConfigError(str(err)) from err
    if collectives.cp_size() > 1:  # the attention modules run the exchange: before sharding and compile
        if router_aux_coef(model.config):  # a composite's text config: refused for composites before any work
            raise ConfigError(
                f"cp_size={collectives.cp_size()} with a MoE router loss (output_router_logits=true, "
                f"router_aux_loss_coef={router_aux_coef(model.config):g}): the load-balancing loss is a product of "
                "per-expert fractions over a micro-batch's tokens, and each context-parallel rank sees only its part "
                "of them, so it would be another loss; set output_router_logits=false in the model config or cp_size=1"
            )
        cp = ContextParallel(
            collectives.cp_group(), collectives.cp_size(), session.cfg.fsdp.cp_backend, collectives.tp_size()
        )
    return ParallelPlan(
        layer_cls=layer_cls,
        units=fsdp_unit_classes(model, layer_cls),
        tp=tp,
        cp=cp,
        ep=expert_plan(session, model),
        float8=fp8,
        ac=session.sharding.ac,
        compile=session.compile_plan,
    )


def expert_plan(session: Session, model: torch.nn.Module) -> ExpertParallel | None:
    """Expert parallel's step for ``model`` (the policy, or a frozen reference: sharded alike when it has routed
    experts), None without ``ep_size > 1``; the experts' meshes are built once per run (collective: every rank).

    Raises:
        ConfigError: a reference whose experts cannot be split as the run's (read as the run read the policy's).
    """
    f = session.cfg.fsdp
    if (f.ep_size or 1) <= 1 or not find_experts(model):
        return None
    mesh = f.mesh_plan(session.world, launcher_mesh())
    check_expert_split(read_experts(model), mesh)
    if session.expert_meshes is None:
        session.expert_meshes = expert_meshes(mesh, session.device.type)
    return ExpertParallel(session.expert_meshes, rank0_loading=bool(f.fsdp_cpu_ram_efficient_loading))


def build_optimizer(
    session: Session, model: torch.nn.Module, layer_cls: tuple[str, ...]
) -> torch.optim.Optimizer:
    """The run's optimizer on the sharded parameters: AdamW (decay on matrices), or with ``optim: muon`` Muon on the
    decoder layers' matrices (orthogonalised across the shards) and AdamW on the rest.

    Raises:
        ConfigError: Muon with tensor parallel, or with CPU offload on a GPU.
    """
    t, f = session.cfg.train, session.cfg.fsdp
    if t.optim != "muon":
        return build_adamw(
            param_groups(model, t.weight_decay),
            lr=t.learning_rate,
            betas=(t.adam_beta1, t.adam_beta2),
            eps=t.adam_epsilon,
            device_type=session.device.type,
        )
    if (f.ep_size or 1) > 1:
        raise ConfigError(
            f"optim=muon with ep_size={f.ep_size}: Muon's update of the decoder layers' matrices has not been verified "
            "with the experts on their own mesh (expert parallel); use optim=adamw with ep_size, or ep_size=1"
        )
    if collectives.tp_size() > 1:
        raise ConfigError(
            f"optim=muon with tp_size={collectives.tp_size()}: Muon orthogonalises whole matrices gathered from "
            "FSDP2's row blocks, and tensor parallel splits them along another dimension too; use optim=adamw "
            "with tensor parallel, or tp_size=1"
        )
    if f.fsdp_cpu_offload and session.device.type == "cuda":
        raise ConfigError(
            "optim=muon with fsdp_cpu_offload=true: the sharded gradients and momentum live in host memory, and "
            "Muon's all-to-alls of the matrices run on the GPUs' NCCL group, which cannot send host tensors; use "
            "optim=adamw with offload, or fsdp_cpu_offload=false"
        )
    muon = MuonSettings(
        lr=t.muon_lr or t.learning_rate,
        momentum=t.muon_momentum,
        nesterov=t.muon_nesterov,
        ns_steps=t.muon_ns_steps,
        adjust_lr=t.muon_adjust_lr,
        weight_decay=t.weight_decay,
    )
    optimizer, split = build_muon_adamw(
        model,
        layer_cls,
        muon,
        lr=t.learning_rate,
        betas=(t.adam_beta1, t.adam_beta2),
        eps=t.adam_epsilon,
        device_type=session.device.type,
    )
    logger.info(
        "%s; Muon lr %g, momentum %g%s, %d Newton-Schulz steps, lr adjustment %s",
        split.describe(),
        muon.lr,
        muon.momentum,
        " (Nesterov)" if muon.nesterov else "",
        muon.ns_steps,
        muon.adjust_lr,
    )
    if (empty := split.warning()) is not None:
        logger.warning("%s", empty)
    return optimizer


def run_loss_plan(model: torch.nn.Module, ce_chunk_tokens: int, *, reward: bool) -> LossPlan:
    """The loss path for the whole run, agreed by every rank (never chosen per batch), its notes logged."""
    if (
        reward
    ):  # no LM head, no logits over the vocabulary: the step reads the score head's values. No router loss:
        # transformers' sequence-classification models return none (TRL's RewardTrainer adds none either).
        aux = router_aux_coef(model.config)
        loss_plan = LossPlan(
            0,
            notes=(
                "Bradley-Terry on the score head's values (no LM head, no vocabulary logits)",
                *(
                    [
                        f"no router loss (router_aux_loss_coef {aux:g} ignored): a sequence-"
                        "classification model returns none"
                    ]
                    if aux
                    else []
                ),
            ),
        )
    else:
        loss_plan = plan_loss(model, ce_chunk_tokens)
    for line in loss_plan.notes:
        logger.info("loss: %s", line)
    return loss_plan


def _flops_and_peak(session: Session, model: torch.nn.Module) -> tuple[FlopsModel, float | None]:
    """MFU's inputs: FLOPs from the unsharded model's config (a composite's language model: its tower and projector
    never run on text rows, and their FLOPs on images are not counted); the peak from the GPU's name unless ``peak_flops``."""
    d, o = session.cfg.data, session.cfg.observe
    spec = composite_spec(model.config)
    unused = vision_parameters(model, spec) if spec is not None else 0
    flops = flops_model(model.config, active_non_embedding_params(model) - unused)
    on_cuda = session.device.type == "cuda"
    device_name = torch.cuda.get_device_name(session.device) if on_cuda else "cpu"
    peak = o.peak_flops or (peak_flops_for(device_name) if on_cuda else None)
    logger.info(
        "FLOPs per token 6N + 12LHQT = %.3g at T=max_length=%d (N=%.1fM non-embedding parameters a token runs, "
        "L=%d, H=%d, Q=%d; T is each sequence's own length); MFU against %s",
        flops.per_token(d.max_length),
        d.max_length,
        flops.non_embedding_params / 1e6,
        flops.layers,
        flops.heads,
        flops.head_dim,
        f"{peak:.4g} FLOP/s per device ({device_name})"
        if peak
        else f"nothing: no known peak for {device_name} (set peak_flops); achieved TFLOP/s are reported",
    )
    return flops, peak


def build_schedule(session: Session, optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
    """The learning-rate schedule over ``total_steps`` (warmup, then cosine, linear or constant)."""
    t = session.cfg.train
    warmup = warmup_steps_for(total_steps, t.warmup_steps, t.warmup_ratio)
    logger.info("warmup %d steps, schedule %s", warmup, t.lr_scheduler_type)
    return build_scheduler(optimizer, t.lr_scheduler_type, warmup, total_steps)
