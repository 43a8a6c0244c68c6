"""The training loop every method runs: config -> session (accelerator, run folder) -> memory plan -> tokenizer ->
data -> model (sharded) + optimizer -> schedule -> the method's step -> checkpoints (resume) -> loop -> export.

A method (:class:`~hf_fsdp2.run.method.Method`, found through :mod:`hf_fsdp2.methods`) brings its data and its
objective; everything else here is shared, so every method checkpoints, resumes, logs and exports alike.
"""

from __future__ import annotations

from hf_fsdp2 import collectives
from hf_fsdp2.attention_layout import attention_layout_for, check_row_layers, method_rows
from hf_fsdp2.config import Config
from hf_fsdp2.elastic.progress import PROGRESS
from hf_fsdp2.parallel.accelerator import launcher_mesh, world_size
from hf_fsdp2.parallel.ring import check_ring_settings
from hf_fsdp2.plan import log_run_plan
from hf_fsdp2.run.build import build_model, build_schedule, load_run_tokenizer
from hf_fsdp2.run.finish import finish
from hf_fsdp2.run.method import Method
from hf_fsdp2.run.observer import Observer
from hf_fsdp2.run.registry import check_capabilities
from hf_fsdp2.run.session import Session
from hf_fsdp2.run.state import RunState


def run(cfg: Config, method: Method) -> None:
    """Train ``method`` with ``cfg`` (every rank), then export.

    Args:
        cfg: the parsed config (:func:`hf_fsdp2.methods.parse_method_config`: the method's section included).
        method: the training method.
    """
    objective = method.objective(cfg)  # the method's checks, every rank alike, before any work
    # The layouts the method's step supports (cp, ring, tp, fp8), from the config and the launch's world alone.
    check_capabilities(method, cfg, cfg.fsdp.mesh_plan(world_size(), launcher_mesh()))
    # Everything checkable before any work; the session owns the run folder.
    with Session.start(cfg) as session:
        # What ring attention cannot run, before the model loads.
        if collectives.cp_size() > 1 and cfg.fsdp.cp_backend == "ring":
            packing, padding_free = method_rows(cfg.data, method.batch_rows)
            check_ring_settings(
                on_gpu=session.device.type == "cuda",
                packing=packing,
                padding_free=padding_free,
                attn_implementation=cfg.model.attn_implementation,
                model_config=session.model_config,
            )
        # Rows of several documents, or context parallel, on a model whose layers carry state along a row (Mamba,
        # linear attention), and the batch layout's other refusals (masks that let documents see each other, kernels
        # that cannot load): from the config and the environment, every rank alike, before the data is tokenized.
        packing, padding_free = method_rows(cfg.data, method.batch_rows)
        check_row_layers(
            session.model_config, packing=packing, padding_free=padding_free, cp_size=collectives.cp_size()
        )
        attention_layout_for(
            cfg, session.model_config, device_type=session.device.type, batch_rows=method.batch_rows
        )
        # The per-rank memory plan from the model config (rank 0; a meta model, no collective; never fails).
        if session.is_main:
            session.memory_plan = log_run_plan(
                cfg, session.model_config, world_size=session.world, device=session.device, method=method
            )
        tokenizer = load_run_tokenizer(session)
        data = method.build_data(session, tokenizer)  # rank 0 tokenizes first; every rank gets the same steps
        # LoRA, AC, compile, FSDP2 per decoder layer
        model, optimizer = build_model(
            session, tokenizer, no_dropout=objective.no_dropout, reward=objective.reward_model
        )
        scheduler = build_schedule(session, optimizer, data.total_steps)
        # The step function (SFT: token-normalised CE; DPO: the reference built or precomputed now).
        train_step, evaluator = objective.build(session, model, optimizer, scheduler, data)
        # Resume, if asked (the step's buffer too); the disk checked for the checkpoints and export the run plans.
        state = RunState(
            session,
            model.module,
            optimizer,
            scheduler=scheduler,
            stream=data.stream,
            total_steps=data.total_steps,
            step=train_step,
        )
        observer = Observer(
            session,
            model,
            tokenizer,
            eval_set=data.eval_set,
            collator=data.collator,
            first_step=state.first_step,
            total_steps=data.total_steps,
            evaluator=evaluator,
        )
        batches = observer.timed(data.stream)

        # The loop: one optimizer step over gradient_accumulation_steps micro-batches per rank (the objective's
        # normalised loss, clip, step), then metrics and eval, then checkpoints and SIGTERM.
        model.module.train()
        for step in range(state.first_step, data.total_steps + 1):
            PROGRESS.begin_step(step)  # what the hang watchdog watches, and a failing rank records
            observer.start_step(step)
            # The step says what it reads: gradient_accumulation_steps batches, or (GRPO) one prompt batch per
            # generation batch it samples.
            micro_batches = [next(batches) for _ in range(train_step.reads(step))]
            out = train_step(micro_batches)
            observer.end_step(step, list(out.trained), out, model.module, epoch=data.stream.epoch)
            if state.after_step(step, data.total_steps):  # SIGTERM: saved, stop here
                observer.close()
                session.accelerator.end_training()
                return

        # The verified export (the final state saved first if it fails), the summary, the push.
        finish(
            session,
            model,
            tokenizer,
            state,
            observer,
            first_step=state.first_step,
            last_step=data.total_steps,
            method=method,
        )
