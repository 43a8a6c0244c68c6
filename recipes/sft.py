"""Supervised fine-tuning of an HF causal LM with FSDP2 through Accelerate.

GPU node (8 GPUs):
    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/sft.py \
        --config recipes/configs/llama3_8b_sft.yaml
CPU machine (2 gloo processes; the same FSDP2 code path):
    accelerate launch --config_file accelerate_configs/fsdp2_cpu.yaml recipes/sft.py \
        --config recipes/configs/demo_smollm2.yaml
    torchrun --nproc_per_node 2 recipes/sft.py --config recipes/configs/demo_smollm2.yaml
Any key of the YAML can be overridden on the command line: ``--learning_rate 1e-5``.

Order: config -> session (accelerator, run folder) -> memory plan -> tokenizer -> data -> model (sharded) +
optimizer -> schedule -> checkpoints (resume) -> loop -> export.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hf_fsdp2.config import Config, parse_config
from hf_fsdp2.plan import log_run_plan
from hf_fsdp2.trainer.finish import finish, run_recipe
from hf_fsdp2.trainer.model import build_model, build_schedule, load_run_tokenizer
from hf_fsdp2.trainer.objective import SFT, Objective
from hf_fsdp2.trainer.observer import Observer
from hf_fsdp2.trainer.session import Session
from hf_fsdp2.trainer.sft_data import TrainData, build_sft_data
from hf_fsdp2.trainer.state import RunState


def main(argv: list[str] | None = None) -> None:
    # Config (YAML + CLI, validated); the recipe's data: chat / prompt-completion / text examples with loss masks.
    run(parse_config(argv), build_sft_data, recipe="sft")


def run(
    cfg: Config, build_data: Callable[[Session, Any], TrainData], *, recipe: str, objective: Objective = SFT
) -> None:
    """Train ``objective`` with ``cfg`` on the micro-batches ``build_data`` makes (every rank), then export."""
    # Everything checkable before any work; the session owns the run folder.
    with Session.start(cfg) as session:
        t = cfg.train
        # The per-rank memory plan from the model config (rank 0; a meta model, no collective; never fails).
        if session.is_main:
            log_run_plan(
                cfg, session.model_config, world_size=session.world, device=session.device, recipe=recipe
            )
        tokenizer = load_run_tokenizer(session)
        data = build_data(session, tokenizer)  # rank 0 tokenizes first; every rank gets the same steps
        # LoRA, AC, compile, FSDP2 per decoder layer
        model, optimizer = build_model(
            session, tokenizer, no_dropout=objective.no_dropout, reward=objective.reward_model
        )
        scheduler = build_schedule(session, optimizer, data.total_steps)
        # The step function (SFT: token-normalised CE; DPO: the reference built or precomputed now).
        train_step, evaluator = objective.build(session, model, optimizer, scheduler, data)
        # Resume, if asked; the disk checked for the checkpoints and export the run plans.
        state = RunState(session, model.module, optimizer, scheduler, data.stream, data.total_steps)
        observer = Observer(
            session, model, tokenizer, eval_set=data.eval_set, collator=data.collator,
            first_step=state.first_step, total_steps=data.total_steps, evaluator=evaluator,
        )  # fmt: skip
        batches = observer.timed(data.stream)

        # The loop: one optimizer step over gradient_accumulation_steps micro-batches per rank (the objective's
        # normalised loss, clip, step), then metrics and eval, then checkpoints and SIGTERM.
        model.module.train()
        for step in range(state.first_step, data.total_steps + 1):
            observer.start_step(step)
            micro_batches = [next(batches) for _ in range(t.gradient_accumulation_steps)]
            out = train_step(micro_batches)
            observer.end_step(step, micro_batches, out, model.module, epoch=data.stream.epoch)
            if state.after_step(step, data.total_steps):  # SIGTERM: saved, stop here
                observer.close()
                session.accelerator.end_training()
                return

        # The verified export (the final state saved first if it fails), the summary, the push.
        finish(
            session, model, tokenizer, state, observer, first_step=state.first_step, last_step=data.total_steps,
            recipe=recipe,
        )  # fmt: skip


if __name__ == "__main__":
    run_recipe(main)
