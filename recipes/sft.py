"""Supervised fine-tuning of an HF causal LM with FSDP2 through Accelerate.

GPU node (8 GPUs):
    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/sft.py \
        --config recipes/configs/llama3_8b_sft.yaml
CPU machine (2 gloo processes; the same FSDP2 code path):
    accelerate launch --config_file accelerate_configs/fsdp2_cpu.yaml recipes/sft.py \
        --config recipes/configs/demo_smollm2.yaml
    torchrun --nproc_per_node 2 recipes/sft.py --config recipes/configs/demo_smollm2.yaml
Any key of the YAML can be overridden on the command line: ``--learning_rate 1e-5``.

Order: config -> accelerator -> tokenizer/model -> shard -> data -> optimizer/schedule -> loop -> export.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader

from hf_fsdp2.checkpoint import (
    Checkpointer,
    CheckpointError,
    StopRequest,
    TrainerState,
    check_config_compatible,
    checkpoint_dir,
    resolve_resume,
)
from hf_fsdp2.collectives import rank0_decides, rank0_first
from hf_fsdp2.config import CONFIG_NAME, Config, ConfigError, parse_config, parse_size, save_config
from hf_fsdp2.config.plans import (
    PACKED_ATTENTION_IMPLEMENTATIONS,
    ACPlan,
    CompilePlan,
    LoraSettings,
    ShardingPlan,
    parse_step_range,
)
from hf_fsdp2.data.loader import PaddingCollator, ShardedSampler, build_dataloader
from hf_fsdp2.data.mixture import build_sft_datasets_from_config
from hf_fsdp2.data.packing import PackedCollator, layout_summary, pack_examples
from hf_fsdp2.export import ExportError, checkpoint_layout, export_model, last_metrics
from hf_fsdp2.export.hub import (
    RUN_FOLDER_IGNORE,
    CheckpointPusher,
    HubError,
    check_can_push,
    push_folder,
    render_model_card,
)
from hf_fsdp2.lora.adapter import LoraError, apply_lora, format_memory_report, memory_report
from hf_fsdp2.lora.merge import check_mergeable
from hf_fsdp2.lora.save import export_lora
from hf_fsdp2.model import (
    check_max_length,
    check_vocab,
    count_parameters,
    decoder_layer_classes,
    load_model,
    load_model_config,
    load_tokenizer,
    resize_embeddings,
)
from hf_fsdp2.observe.evaluate import Evaluator
from hf_fsdp2.observe.flops import flops_model, non_embedding_params, peak_flops_for
from hf_fsdp2.observe.logs import MetricsWriter, Progress
from hf_fsdp2.observe.meter import StepMeter
from hf_fsdp2.observe.profiling import StepProfiler, apply_distributed_debug
from hf_fsdp2.observe.summary import format_summary, run_summary, write_summary
from hf_fsdp2.observe.trackers import build_trackers, tracker_config, tracker_values
from hf_fsdp2.parallel.accelerator import (
    build_accelerator,
    describe_policy,
    has_accelerator_device,
    launcher_overrides,
    prepare_fsdp2,
    setup_logging,
    sharded_units,
)
from hf_fsdp2.parallel.compiling import CompileWatch
from hf_fsdp2.parallel.kernels import KernelError, apply_liger_kernels, check_liger_available
from hf_fsdp2.run_dir import RunLock, check_output_dir
from hf_fsdp2.train.loss import plan_loss
from hf_fsdp2.train.optim import (
    build_adamw,
    build_scheduler,
    param_groups,
    restore_scheduler,
    warmup_steps_for,
)
from hf_fsdp2.train.step import StepSettings, train_step

logger = logging.getLogger("hf_fsdp2")


@dataclass
class DataCursor:
    """Where the data stream is: the epoch and the micro-batches of it consumed so far (saved in checkpoints)."""

    epoch: int = 0
    batches_in_epoch: int = 0


def batches_forever(loader: DataLoader, sampler: ShardedSampler, cursor: DataCursor) -> Iterator[dict]:
    """Micro-batches across epochs from the cursor on; each epoch reshuffles with seed + epoch."""
    while True:
        sampler.set_epoch(cursor.epoch)  # the same epoch keeps a resumed position
        for batch in loader:
            cursor.batches_in_epoch += 1
            yield batch
        cursor.epoch, cursor.batches_in_epoch = cursor.epoch + 1, 0


def main(argv: list[str] | None = None) -> None:
    # ---- config: YAML + CLI, validated; nothing heavy happens before it is known to be sane.
    run_start = time.perf_counter()
    cfg = parse_config(argv)
    m, d, t, f, e, o = cfg.model, cfg.data, cfg.train, cfg.fsdp, cfg.export, cfg.observe
    # Hub: repo id, offline mode and token are checked before any work (every rank, no network).
    pushes = e.push_to_hub or e.push_checkpoints_to_branch
    hub_token = check_can_push(e.hub_model_id, e.hub_token) if pushes else None
    e.hub_token = None  # never written to disk: resolved config, checkpoints, model card
    assert m.model_name_or_path and t.output_dir  # validate() guarantees them
    output_dir = Path(t.output_dir)
    check_output_dir(
        output_dir, overwrite=t.overwrite_output_dir, resume=t.resume_from_checkpoint is not None
    )
    model_config = load_model_config(
        m.model_name_or_path, revision=m.model_revision, trust_remote_code=m.trust_remote_code
    )
    check_max_length(d.max_length, model_config)

    # ---- accelerator: FSDP2 through Accelerate, on GPU or CPU/gloo; debug variables before the process
    # group exists, trackers (checked installed) before any work.
    debug_env = apply_distributed_debug(o.distributed_debug, output_dir / "debug")
    trackers = build_trackers(
        o.report_to,
        output_dir / "tensorboard",
        project=o.tracker_project,
        run_name=o.run_name or output_dir.name,
    )
    compile_on = f.torch_compile if f.torch_compile is not None else has_accelerator_device()
    if t.use_liger_kernel:  # package and GPU checked before any work
        check_liger_available(has_accelerator_device())
    plan = ShardingPlan(
        reshard_after_forward=f.fsdp_reshard_after_forward,
        cpu_offload=f.fsdp_cpu_offload,
        cpu_ram_efficient_loading=f.fsdp_cpu_ram_efficient_loading,
        activation_checkpointing=ACPlan(f.ac_mode(), f.ac_every_k, pin_memory=has_accelerator_device()),
        reduce_dtype=f.fsdp_reduce_dtype,
    )
    compile_plan = CompilePlan(
        enabled=compile_on,
        scope=f.torch_compile_scope,
        mode=f.torch_compile_mode,
        dynamic=f.torch_compile_dynamic,
        fullgraph=f.torch_compile_fullgraph,
    )
    accelerator = build_accelerator(
        plan,
        mixed_precision=t.mixed_precision,
        compile_plan=compile_plan,
        timeout_s=t.ddp_timeout,
        log_with=trackers,
    )
    setup_logging(accelerator.is_main_process)
    logger.info(
        "collective timeout ddp_timeout=%ds; debug variables: %s",
        t.ddp_timeout,
        ", ".join(debug_env) or "none (distributed_debug=off)",
    )
    for note in launcher_overrides(plan, t.mixed_precision):
        logger.info("the recipe's value is used over accelerate launch's: %s", note)
    if t.mixed_precision == "no" and m.torch_dtype != "float32":
        logger.warning(
            "mixed_precision=no with torch_dtype=%s trains in %s throughout (no fp32 master weights); "
            "use mixed_precision=bf16 for bf16 compute with fp32 master weights",
            m.torch_dtype,
            m.torch_dtype,
        )
    # Rank 0 takes the run folder (an exclusive lock) before anything is written, then checks it again:
    # another run may have used it since the first check. Its refusal is raised on every rank.
    run_lock = RunLock(output_dir)
    resume = t.resume_from_checkpoint is not None
    rank0_decides(lambda: claim_output_dir(run_lock, overwrite=t.overwrite_output_dir, resume=resume))
    try:
        _train(
            cfg,
            accelerator,
            plan=plan,
            compile_plan=compile_plan,
            model_config=model_config,
            hub_token=hub_token,
            run_start=run_start,
        )
    finally:
        run_lock.release()


def claim_output_dir(lock: RunLock, *, overwrite: bool, resume: bool) -> None:
    """Rank 0: lock the run folder, then check it holds no other run; the lock is dropped on refusal."""
    lock.acquire()
    try:
        check_output_dir(lock.path.parent, overwrite=overwrite, resume=resume)
    except ConfigError:
        lock.release()
        raise


def _train(
    cfg: Config,
    accelerator: Accelerator,
    *,
    plan: ShardingPlan,
    compile_plan: CompilePlan,
    model_config: Any,
    hub_token: str | None,
    run_start: float,
) -> None:
    m, d, t, f, e, o = cfg.model, cfg.data, cfg.train, cfg.fsdp, cfg.export, cfg.observe
    output_dir = Path(t.output_dir or "")
    world = accelerator.num_processes
    compile_on = compile_plan.enabled
    if accelerator.is_main_process:
        save_config(cfg, output_dir / CONFIG_NAME)
    if o.distributed_debug == "detail":
        (output_dir / "debug").mkdir(parents=True, exist_ok=True)  # every rank (node): flight-recorder dumps
    set_seed(t.seed)
    logger.info("world size %d on %s; mixed precision %s", world, accelerator.device, t.mixed_precision)
    logger.info(
        "FSDP2 mixed-precision policy: %s",
        describe_policy(accelerator.state.fsdp_plugin.mixed_precision_policy),
    )

    # ---- tokenizer + data (rank 0 first, so that a hub download happens once).
    tokenizer = load_tokenizer(
        m.tokenizer_name_or_path or m.model_name_or_path,
        revision=m.model_revision,
        trust_remote_code=m.trust_remote_code,
    )
    vocab_note = check_vocab(len(tokenizer), model_config, resize=m.resize_token_embeddings)
    # Rank 0 tokenizes and writes the datasets cache; the other ranks then load it instead of tokenizing.
    # A failure (a missing file, a bad record) is raised on every rank as one error.
    data = rank0_first(lambda: build_sft_datasets_from_config(d, tokenizer, seed=t.seed))
    for line in data.summary_lines(d.max_length):
        logger.info(line)
    # Packed once, deterministically, before sampling: the sampler indexes rows, so resume stays O(1).
    dataset = pack_examples(data.train, d.max_length) if d.packing else data.train
    collator = (
        PackedCollator(pad_token_id=tokenizer.pad_token_id, padding_free=d.padding_free)
        if d.packing or d.padding_free
        else PaddingCollator(pad_token_id=tokenizer.pad_token_id)
    )
    logger.info(
        layout_summary(
            data.train,
            dataset if d.packing else None,
            batch_size=t.per_device_train_batch_size,
            world_size=world,
            seed=t.seed,
            padding_free=d.padding_free,
        )
    )
    per_step = world * t.per_device_train_batch_size * t.gradient_accumulation_steps
    if len(dataset) < per_step:
        unit = "packed rows" if d.packing else "examples"
        raise ConfigError(
            f"one optimizer step needs world_size({world}) x per_device_train_batch_size"
            f"({t.per_device_train_batch_size}) x gradient_accumulation_steps({t.gradient_accumulation_steps}) "
            f"= {per_step} {unit} but the dataset has {len(dataset)}; lower the batch size or the accumulation"
        )
    sampler = ShardedSampler(len(dataset), rank=accelerator.process_index, world_size=world, seed=t.seed)
    loader = build_dataloader(
        dataset,
        batch_size=t.per_device_train_batch_size,
        collator=collator,
        sampler=sampler,
        num_workers=d.dataloader_num_workers,
    )
    steps_per_epoch = len(loader) // t.gradient_accumulation_steps
    total_steps = t.max_steps if t.max_steps > 0 else math.ceil(t.num_train_epochs * steps_per_epoch)

    # ---- model, sharded per decoder layer.
    model = load_model(
        m.model_name_or_path,
        dtype=m.torch_dtype,
        attn_implementation=m.attn_implementation,
        revision=m.model_revision,
        trust_remote_code=m.trust_remote_code,
        # Rank-0-only loading: the other ranks build the model on meta and receive their shards in prepare.
        empty_weights=f.fsdp_cpu_ram_efficient_loading and accelerator.process_index != 0,
    )
    if vocab_note:
        logger.info(vocab_note)
        resize_embeddings(model, len(tokenizer))
    # The export's checkpoint layout (names, per-expert splits of fused MoE tensors), planned now: a format the
    # export cannot write is refused before training, not after it.
    layout = checkpoint_layout(model, {k: tuple(v.shape) for k, v in model.state_dict().items()})
    if layout.splits:
        logger.info(
            "export: %d fused expert tensors will be written per expert, as transformers saves them",
            len(layout.splits),
        )
    attn = model.config._attn_implementation
    logger.info("attention implementation %s%s", attn, " (chosen by transformers)" if m.attn_implementation == "auto" else "")
    if (d.packing or d.padding_free) and attn not in PACKED_ATTENTION_IMPLEMENTATIONS:
        raise ConfigError(
            f"packing={d.packing}, padding_free={d.padding_free} need an attention implementation that keeps "
            f"examples apart by position_ids, one of {list(PACKED_ATTENTION_IMPLEMENTATIONS)}; the model runs "
            f"{attn!r}: set attn_implementation to one of them or turn packing off"
        )
    lora = cfg.peft
    if lora.use_peft:  # LoRA: the base frozen as loaded, the adapter in fp32; wrapped before sharding
        model = apply_lora(
            model,
            LoraSettings(
                r=lora.lora_r,
                alpha=lora.lora_alpha,
                dropout=lora.lora_dropout,
                target_modules=lora.lora_target_modules,
                modules_to_save=lora.lora_modules_to_save,
                use_rslora=lora.use_rslora,
            ),
            seed=t.seed,
        )
        if lora.merge_adapter:  # what the merged export cannot merge is refused now, not after training
            check_mergeable(model)
        logger.info(format_memory_report(memory_report(model), world))
    layer_cls = decoder_layer_classes(model, f.fsdp_layer_cls_to_wrap)
    n_total, n_trainable = count_parameters(model)
    logger.info(
        "model %s: %.1fM parameters (%.1fM trainable)", type(model).__name__, n_total / 1e6, n_trainable / 1e6
    )
    # MFU: FLOPs from the unsharded model's config; the peak from the GPU's name unless peak_flops is given.
    flops = flops_model(model.config, non_embedding_params(model))
    on_cuda = accelerator.device.type == "cuda"
    device_name = torch.cuda.get_device_name(accelerator.device) if on_cuda else "cpu"
    peak = o.peak_flops or (peak_flops_for(device_name) if on_cuda else None)
    logger.info(
        "FLOPs per token 6N + 12LHQT = %.3g at T=max_length=%d (N=%.1fM non-embedding, L=%d, H=%d, Q=%d; T is "
        "each sequence's own length); MFU against %s",
        flops.per_token(d.max_length), d.max_length, flops.non_embedding_params / 1e6, flops.layers, flops.heads,
        flops.head_dim, f"{peak:.4g} FLOP/s per device ({device_name})" if peak
        else f"nothing: no known peak for {device_name} (set peak_flops); achieved TFLOP/s are reported",
    )  # fmt: skip
    optimizer = build_adamw(
        param_groups(model, t.weight_decay),
        lr=t.learning_rate,
        betas=(t.adam_beta1, t.adam_beta2),
        eps=t.adam_epsilon,
        device_type=accelerator.device.type,
    )
    if t.use_liger_kernel:
        apply_liger_kernels(model)
        logger.info("Liger kernels: RMSNorm, SwiGLU and rotary embeddings (loss: chunked cross entropy)")
    model, optimizer = prepare_fsdp2(
        accelerator, model, optimizer, layer_cls, sharding=plan, compile_plan=compile_plan
    )
    for name, (units, params) in sharded_units(model).items():
        logger.info("FSDP units: %d x %s (%.2fM parameters)", units, name, params / 1e6)
    # Every rank: the loss path for the whole run, agreed by all ranks (never chosen per batch).
    loss_plan = plan_loss(model, t.ce_chunk_tokens)
    for note in loss_plan.notes:
        logger.info("loss: %s", note)
    step_settings = StepSettings(loss_plan, t.max_grad_norm, f.fsdp_sync_each_microbatch)
    logger.info(
        "activation checkpointing %s%s; torch.compile %s",
        plan.ac.mode,
        f" (k={plan.ac.every_k})" if plan.ac.mode == "every_k" else "",
        f"{compile_plan.scope} (compile time reported apart from step time, as compile_s)" if compile_on else "off",
    )
    warmup = warmup_steps_for(total_steps, t.warmup_steps, t.warmup_ratio)
    scheduler = build_scheduler(optimizer, t.lr_scheduler_type, warmup, total_steps)
    logger.info(
        "training %d steps (%d per epoch), %d examples per step, warmup %d, schedule %s",
        total_steps,
        steps_per_epoch,
        per_step,
        warmup,
        t.lr_scheduler_type,
    )

    # ---- checkpoints: resume first, then save every save_steps (and on SIGTERM).
    checkpointer = Checkpointer(
        output_dir,
        keep_last=t.save_total_limit,
        async_save=t.save_async,
        is_main_process=accelerator.is_main_process,
    )
    checkpointer.clean_stale()
    pusher = None  # rank 0 uploads each published checkpoint to a hub branch, in the background
    if e.push_checkpoints_to_branch and e.hub_model_id and hub_token and accelerator.is_main_process:
        pusher = CheckpointPusher(
            output_dir,
            e.hub_model_id,
            e.push_checkpoints_to_branch,
            token=hub_token,
            private=e.hub_private_repo,
        )
    cursor, first_step = DataCursor(), 1
    if t.resume_from_checkpoint:
        path = resolve_resume(output_dir, t.resume_from_checkpoint)
        saved_cfg = yaml.safe_load((path / "hf_fsdp2_config.yaml").read_text())
        for note in check_config_compatible(saved_cfg, cfg.to_flat_dict()):
            logger.info("resuming with a changed setting: %s", note)
        state = checkpointer.load(path, model, optimizer)
        restore_scheduler(scheduler, state.scheduler, t.learning_rate)
        first_step = state.step + 1
        # The data position in examples of the epoch; with another world size or batch size the same
        # number of examples is skipped, in the new layout (see docs: resume on a different world size).
        examples = state.batches_in_epoch * state.per_device_train_batch_size * state.world_size
        per_batch = t.per_device_train_batch_size * world
        cursor = DataCursor(state.epoch, examples // per_batch)
        sampler.load_state_dict(
            {"epoch": cursor.epoch, "position": cursor.batches_in_epoch * t.per_device_train_batch_size}
        )
        if state.world_size != world or examples % per_batch:
            logger.warning(
                "resuming on %d ranks from a checkpoint of %d: weights and optimizer state are the same, the "
                "order of the remaining examples of this epoch is not",
                world,
                state.world_size,
            )
        logger.info(
            "resumed from %s at step %d (epoch %d, batch %d)",
            path,
            state.step,
            cursor.epoch,
            cursor.batches_in_epoch,
        )
    config_yaml = yaml.safe_dump(cfg.to_flat_dict(), sort_keys=False)

    def save(step: int) -> None:
        state = TrainerState(
            step=step,
            epoch=cursor.epoch,
            batches_in_epoch=cursor.batches_in_epoch,
            world_size=world,
            scheduler=scheduler.state_dict(),
            per_device_train_batch_size=t.per_device_train_batch_size,
            gradient_accumulation_steps=t.gradient_accumulation_steps,
        )
        checkpointer.save(step, model, optimizer, state, config_yaml)
        if pusher is not None:
            pusher.push_new()

    stop = StopRequest().install()

    # ---- observability: eval set (whole examples, not packed), trackers, meter, profiler, progress.
    evaluator = None
    if data.eval is not None:
        evaluator = Evaluator(
            data.eval,
            collator=collator,
            batch_size=o.per_device_eval_batch_size or t.per_device_train_batch_size,
            rank=accelerator.process_index,
            world_size=world,
            device=accelerator.device,
            tokenizer=tokenizer,
            prompts=o.eval_prompts,
            max_new_tokens=o.eval_max_new_tokens,
            output_dir=output_dir,
            is_main_process=accelerator.is_main_process,
            loss_plan=loss_plan,
        )
    accelerator.init_trackers(o.tracker_project, config=tracker_config(cfg.to_flat_dict()))
    meter = StepMeter(
        flops=flops,
        world_size=world,
        device=accelerator.device,
        total_steps=total_steps,
        peak_flops=peak,
        pad_token_id=tokenizer.pad_token_id,
    )
    profiler = StepProfiler(
        profile_steps=parse_step_range(o.profile_steps, "profile_steps"),
        memory_steps=parse_step_range(o.memory_snapshot_steps, "memory_snapshot_steps"),
        output_dir=output_dir,
        rank=accelerator.process_index,
        device=accelerator.device,
        first_step=first_step,
        last_step=total_steps,
    )

    # ---- the loop.
    metrics = MetricsWriter(
        output_dir,
        enabled=accelerator.is_main_process,
        resume_step=first_step - 1 if first_step > 1 else None,
    )
    progress = Progress(total_steps, first_step, enabled=accelerator.is_main_process)
    batches = meter.wrap(batches_forever(loader, sampler, cursor))  # times the wait for data
    compile_watch = CompileWatch(enabled=compile_on).start()
    compile_totals = {"compile_s": 0.0}
    record: dict | None = None
    eval_fields: dict | None = None
    model.train()
    for step in range(first_step, total_steps + 1):
        profiler.start_step(step)
        meter.start_step()
        micro_batches = [next(batches) for _ in range(t.gradient_accumulation_steps)]
        meter.count(micro_batches)  # non-pad tokens and FLOPs, on the host
        out = train_step(model, optimizer, scheduler, micro_batches, step_settings, accelerator.device)
        if out.target_tokens == 0:
            logger.warning("step %d has no target token on any rank: its gradient is zero", step)
        eval_now = evaluator is not None and (
            step == total_steps or (o.eval_steps and step % o.eval_steps == 0)
        )
        log_now = step % t.logging_steps == 0 or step == total_steps or eval_now
        meter.end_step(out.target_tokens, sync=log_now)
        profiler.end_step(step)
        progress.step()
        if log_now:
            stats = meter.collect(step, out.loss_sum)  # every rank: one all_gather of a few numbers
            record = {
                "step": step,
                "loss": stats.pop("loss_sum") / max(out.target_tokens, 1),
                "lr": out.lr,
                "grad_norm": float(out.grad_norm),
                "target_tokens": out.target_tokens,
                "padding_efficiency": out.target_tokens / max(out.processed_tokens, 1),
                **stats,
                "epoch": sampler.epoch,
            }
            aux = out.aux_loss(t.gradient_accumulation_steps)  # every rank (collective when MoE)
            if aux is not None:  # the router loss, logged apart from the token loss
                record["aux_loss"] = aux
            compiled = compile_watch.take()  # seconds spent compiling inside these steps, recompiles so far
            if compiled:
                compile_totals["compile_s"] += compiled["compile_s"]
                compile_totals.update({k: v for k, v in compiled.items() if k != "compile_s"})
                record.update(compiled)
            if evaluator is not None and eval_now:  # every rank
                eval_fields = evaluator.run(model, step, log=accelerator.log)
                record.update(eval_fields)
            metrics.write(record)
            accelerator.log(tracker_values(record), step=step)
            progress.log(record)
        saved = False
        if t.save_steps and (step % t.save_steps == 0 or step == total_steps):
            save(step)
            saved = True
        if stop.should_stop():  # every rank: SIGTERM on any rank stops all at this step boundary
            if not saved:
                save(step)
            checkpointer.wait()
            profiler.close()
            progress.close()
            logger.warning(
                "SIGTERM: saved checkpoint-%d and stopped; continue with --resume_from_checkpoint latest",
                step,
            )
            accelerator.end_training()
            return
    checkpointer.wait()
    profiler.close()
    progress.close()
    if pusher is not None:
        pusher.push_new()

    # ---- export: consolidated HF folder in output_dir, written by every rank (none gathers the
    # model), verified against the live model, then published; a model card from the run.
    unwrapped = accelerator.unwrap_model(model)
    card = None
    if accelerator.is_main_process:
        card = render_model_card(
            cfg.to_flat_dict(),
            metrics=last_metrics(output_dir),
            world_size=world,
            repo_id=e.hub_model_id if e.push_to_hub else None,
        )
    # A failure here (a rejected export, a full disk) never loses the run: the final state is saved as a
    # sharded checkpoint first (every rank: the failure was raised on every rank), and the error says
    # how to export it offline.
    try:
        if lora.use_peft:  # the adapter in output_dir (as TRL), the merged model in output_dir/merged if asked
            export_lora(
                model,
                output_dir,
                base_model=m.model_name_or_path,
                tokenizer=tokenizer,
                merge=lora.merge_adapter,
                layer_cls_names=layer_cls,
                mp_policy=accelerator.state.fsdp_plugin.mixed_precision_policy,
                dtype=e.export_dtype,
                max_shard_bytes=parse_size(e.max_shard_size),
                compute_dtype=torch.bfloat16 if t.mixed_precision == "bf16" else torch.float32,
                verify=e.export_verify,
                verify_atol=e.export_verify_atol,
                model_card=card,
                is_main_process=accelerator.is_main_process,
            )
        else:
            export_model(
                model,
                output_dir,
                config=unwrapped.config,
                tokenizer=tokenizer,
                generation_config=getattr(unwrapped, "generation_config", None),
                dtype=e.export_dtype,
                max_shard_bytes=parse_size(e.max_shard_size),
                model_card=card,
                verify=e.export_verify,
                verify_atol=e.export_verify_atol,
                compute_dtype=torch.bfloat16 if t.mixed_precision == "bf16" else None,
            )
    except Exception as err:  # whatever it was; a bug's traceback is kept, after the weights are safe
        saved_final = checkpoint_dir(output_dir, total_steps)
        if not (saved_final / "trainer_state.json").is_file():
            save(total_steps)
            checkpointer.wait()
        rescue = (
            f"The trained weights are safe in {saved_final} (a sharded checkpoint). Export them offline with: "
            f"hf-fsdp2 export {saved_final} OUT_DIR"
        )
        if isinstance(err, (ExportError, LoraError, OSError)):
            raise ExportError(f"{err}\n{rescue}") from err
        logger.error("the export failed: %s", rescue)
        raise
    summary = run_summary(
        meter,
        first_step=first_step,
        last_step=total_steps,
        wall_seconds=time.perf_counter() - run_start,
        last_record=record,
        last_eval=eval_fields,
        export_dir=output_dir,
        compile_stats=compile_totals if compile_on else None,
    )
    for line in format_summary(summary):
        logger.info(line)
    if accelerator.is_main_process:
        write_summary(summary, output_dir)
    accelerator.end_training()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()

    # ---- hub: rank 0 alone, once the other ranks are released (an upload can outlast any collective
    # timeout). A failed push leaves the local export as it is.
    if accelerator.is_main_process and e.push_to_hub and e.hub_model_id:
        push_folder(
            output_dir,
            e.hub_model_id,
            token=hub_token,
            private=e.hub_private_repo,
            revision=e.hub_revision,
            commit_message=e.hub_commit_message or f"hf_fsdp2 sft: {total_steps} steps",
            ignore_patterns=RUN_FOLDER_IGNORE,
        )
    if pusher is not None:
        pusher.wait()  # raises HubError naming each checkpoint whose upload failed


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, CheckpointError, ExportError, HubError, KernelError, LoraError, FileNotFoundError, ValueError) as err:
        # Bad input: one clear line instead of a traceback (HF_FSDP2_DEBUG=1 shows it). Every rank raised the
        # same error; rank 0 says it once.
        if os.environ.get("HF_FSDP2_DEBUG"):
            raise
        if os.environ.get("RANK", "0") == "0":
            print(f"hf_fsdp2 error: {err}", file=sys.stderr)
        sys.exit(2)
    # Everything is written and every process group destroyed. Leave without interpreter finalization:
    # on gloo, C++ worker threads can still hold tensors of finished collectives whose destruction
    # during finalization aborts the process (SIGABRT, "terminate called without an active exception")
    # after a successful run; pytorch/pytorch#179291 describes it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
