"""What a run reports around its steps: the step meter, the metrics file and trackers, the progress bar,
the profiler, compile time, and evaluation. Every rank holds one and calls it at every step (logging
steps do one small collective)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from hf_fsdp2.config.plans import parse_step_range
from hf_fsdp2.elastic.progress import PROGRESS
from hf_fsdp2.observe.evaluate import Evaluator
from hf_fsdp2.observe.logs import MetricsWriter, Progress
from hf_fsdp2.observe.meter import StepMeter
from hf_fsdp2.observe.profiling import StepProfiler
from hf_fsdp2.observe.trackers import tracker_config, tracker_values
from hf_fsdp2.parallel.compiling import CompileWatch
from hf_fsdp2.parallel.experts import expert_load_metrics
from hf_fsdp2.run.build import TrainModel
from hf_fsdp2.run.session import Session
from hf_fsdp2.train.step import StepOutput

logger = logging.getLogger("hf_fsdp2")


class Observer:
    """Meter, metrics, trackers, progress, profiler, compile watch and evaluator of one run.

    Args:
        session: the run.
        model: the sharded model and its loss plan.
        tokenizer: for eval samples and pad detection.
        eval_set: tokenized eval examples (whole examples, never packed), or None.
        collator: the training collator (eval batches the same way).
        first_step: the first step this process runs (after a resume, the one after the checkpoint's).
        total_steps: the run's last step.
        evaluator: the recipe's own evaluator (``run(model, step, log) -> metrics``); default the SFT one on
            ``eval_set``.
    """

    def __init__(
        self,
        session: Session,
        model: TrainModel,
        tokenizer: Any,
        *,
        eval_set: Any,
        collator: Any,
        first_step: int,
        total_steps: int,
        evaluator: Any = None,
    ) -> None:
        cfg, o, t = session.cfg, session.cfg.observe, session.cfg.train
        self.session, self.total_steps = session, total_steps
        self.evaluator = evaluator
        if eval_set is not None and evaluator is None:
            self.evaluator = Evaluator(
                eval_set,
                collator=collator,
                batch_size=o.per_device_eval_batch_size or t.per_device_train_batch_size,
                rank=session.data_rank,
                world_size=session.data_world,
                device=session.device,
                tokenizer=tokenizer,
                prompts=o.eval_prompts,
                max_new_tokens=o.eval_max_new_tokens,
                output_dir=session.output_dir,
                is_main_process=session.is_main,
                loss_plan=model.loss_plan,
            )
        session.accelerator.init_trackers(o.tracker_project, config=tracker_config(cfg.to_flat_dict()))
        self.meter = StepMeter(
            flops=model.flops,
            world_size=session.world,
            device=session.device,
            total_steps=total_steps,
            peak_flops=model.peak_flops,
            pad_token_id=tokenizer.pad_token_id,
        )
        self.profiler = StepProfiler(
            profile_steps=parse_step_range(o.profile_steps, "profile_steps"),
            memory_steps=parse_step_range(o.memory_snapshot_steps, "memory_snapshot_steps"),
            output_dir=session.output_dir,
            rank=session.rank,
            device=session.device,
            first_step=first_step,
            last_step=total_steps,
        )
        self.metrics = MetricsWriter(
            session.output_dir,
            enabled=session.is_main,
            resume_step=first_step - 1 if first_step > 1 else None,
        )
        self.progress = Progress(total_steps, first_step, enabled=session.is_main)
        self.compile_watch = CompileWatch(enabled=session.compile_plan.enabled).start()
        self.compile_totals: dict[str, float] = {"compile_s": 0.0}
        self.record: dict[str, Any] | None = None
        self.eval_fields: dict[str, Any] | None = None

    def timed(self, batches: Iterable[dict[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
        """The micro-batches, with the time spent waiting for each measured (``data_wait_s``)."""
        return self.meter.wrap(iter(batches))

    def start_step(self, step: int) -> None:
        self.profiler.start_step(step)
        self.meter.start_step()

    def end_step(
        self,
        step: int,
        micro_batches: list[dict[str, torch.Tensor]],
        out: StepOutput,
        model: torch.nn.Module,
        epoch: int,
    ) -> dict[str, Any] | None:
        """Count, log (every ``logging_steps``, the last step and eval steps) and evaluate; every rank calls it.

        Returns:
            The step's metrics record when it was logged, else None.
        """
        o, t = self.session.cfg.observe, self.session.cfg.train
        if out.target_tokens == 0:
            logger.warning("step %d has no target token on any rank: its gradient is zero", step)
        self.meter.count(micro_batches)  # non-pad tokens and FLOPs, on the host
        eval_now = self.evaluator is not None and (
            step == self.total_steps or bool(o.eval_steps and step % o.eval_steps == 0)
        )
        log_now = step % t.logging_steps == 0 or step == self.total_steps or eval_now
        self.meter.end_step(out.target_tokens, sync=log_now)
        self.profiler.end_step(step)
        self.progress.step()
        if not log_now:
            return None
        stats = self.meter.collect(step, out.loss_sum)  # every rank: one all_gather of a few numbers
        record: dict[str, Any] = {
            "step": step,
            "loss": stats.pop("loss_sum") / max(out.loss_count, 1),
            "lr": out.lr,
            "grad_norm": float(out.grad_norm),
            "target_tokens": out.target_tokens,
            "padding_efficiency": out.target_tokens / max(out.processed_tokens, 1),
            **stats,
            "epoch": epoch,
        }
        # Every rank (collective when there is any): the router loss, logged apart from the token loss; DPO's
        # rewards, accuracy, margins and log-probs.
        record.update(out.extra_metrics(len(micro_batches)))
        # Every rank (one all-reduce on an MoE, none on a dense model: the same on every rank, read from the model's
        # structure): the least and most loaded expert since the last log, as multiples of an even load.
        record.update(expert_load_metrics(model, self.session.device))
        compiled = self.compile_watch.take()  # seconds spent compiling inside these steps, recompiles so far
        if compiled:
            self.compile_totals["compile_s"] += compiled["compile_s"]
            self.compile_totals.update({k: v for k, v in compiled.items() if k != "compile_s"})
            record.update(compiled)
        if self.evaluator is not None and eval_now:  # every rank
            with PROGRESS.unwatched("evaluation"):
                self.eval_fields = self.evaluator.run(model, step, log=self.session.accelerator.log)
            record.update(self.eval_fields)
            # Compile time outside the steps (eval runs eagerly, so normally none) must not be taken off the next
            # interval's step time: read it now and keep it apart.
            outside = self.compile_watch.take()
            if outside:
                self.compile_totals["compile_outside_steps_s"] = (
                    self.compile_totals.get("compile_outside_steps_s", 0.0) + outside["compile_s"]
                )
                self.compile_totals.update({k: v for k, v in outside.items() if k != "compile_s"})
        self.metrics.write(record)
        self.session.accelerator.log(tracker_values(record), step=step)
        self.progress.log(record)
        self.record = record
        return record

    def close(self) -> None:
        self.profiler.close()
        self.progress.close()
