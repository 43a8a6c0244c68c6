"""Checkpoints of a run: resume first, then a sharded checkpoint every ``save_steps`` and at the end, on
SIGTERM, and (by :mod:`.finish`) whenever the final export fails; each one optionally pushed to a hub branch.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from hf_fsdp2.checkpoint.checkpointer import Checkpointer
from hf_fsdp2.checkpoint.layout import CONFIG_FILE, STATE_FILE, CheckpointError, TrainerState, checkpoint_dir
from hf_fsdp2.checkpoint.preemption import StopRequest
from hf_fsdp2.checkpoint.resume import check_config_compatible, list_checkpoints, new_run_id, resolve_resume
from hf_fsdp2.checkpoint.space import check_disk_space, checkpoint_bytes, export_bytes, planned_checkpoints
from hf_fsdp2.collectives import broadcast_object, gather_objects
from hf_fsdp2.config.sources import parse_source, resolve_sources
from hf_fsdp2.data.fingerprint import changed_files, data_fingerprint
from hf_fsdp2.elastic.attempts import describe_restart, rank_place, read_history, record_layout, take_previous
from hf_fsdp2.elastic.kill_window import KillWindow
from hf_fsdp2.elastic.progress import PROGRESS
from hf_fsdp2.export.hub import CheckpointPusher
from hf_fsdp2.observe.logs import append_metrics_event, last_metrics
from hf_fsdp2.observe.summary import write_summary
from hf_fsdp2.run.session import Session
from hf_fsdp2.train.nonfinite import Finding, NonFiniteGuard, attach
from hf_fsdp2.train.optim import restore_scheduler
from hf_fsdp2.train.step import Step

logger = logging.getLogger("hf_fsdp2")


def _step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.rsplit("-", 1)[-1])


class RunState:
    """The run's checkpoints and the step it starts from; every rank holds one and calls it at every step.

    Args:
        session: the run.
        model: the sharded model.
        optimizer: its optimizer.
        scheduler: its learning-rate schedule.
        stream: the data stream (its position is saved and restored): a ``DataStream`` (epoch and micro-batches
            consumed), or a stream with a per-rank ``state_dict`` (a streamed corpus, GRPO's prompts).
        total_steps: the run's last step (how many checkpoints it writes, for the disk-space check).
        step: the run's step, whose buffer across steps (GRPO's generation batch) each rank's checkpoint keeps
            beside its data position (None: a step without one).

    Raises:
        CheckpointError: a checkpoint that cannot be resumed, or a disk that cannot hold one checkpoint.
    """

    def __init__(
        self,
        session: Session,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scheduler: Any,
        stream: Any,
        total_steps: int = 0,
        step: Step | None = None,
    ) -> None:
        cfg, t, e = session.cfg, session.cfg.train, session.cfg.export
        self.step = step
        self.session, self.model, self.optimizer, self.scheduler, self.stream = (
            session,
            model,
            optimizer,
            scheduler,
            stream,
        )
        self.checkpointer = Checkpointer(
            session.output_dir,
            keep_last=t.save_total_limit,
            async_save=t.save_async,
            is_main_process=session.is_main,
        )
        self.checkpointer.clean_stale()
        self.pusher = None  # rank 0 uploads each published checkpoint to a hub branch, in the background
        if e.push_checkpoints_to_branch and e.hub_model_id and session.hub_token and session.is_main:
            self.pusher = CheckpointPusher(
                session.output_dir,
                e.hub_model_id,
                e.push_checkpoints_to_branch,
                token=session.hub_token,
                private=e.hub_private_repo,
            )
        self.config_yaml = yaml.safe_dump(cfg.to_flat_dict(), sort_keys=False)
        self.first_step = 1
        self.last_saved = 0
        # A new run's identity (rank 0's, the same on every rank); a resumed run keeps its checkpoint's.
        self.checkpointer.run_id = broadcast_object(new_run_id() if session.is_main else "")
        self.data_files = self._fingerprint() if session.is_main else {}  # rank 0 writes the trainer state
        if session.resume_from:
            self._resume(session.resume_from)
        self.restarted = self._take_previous_attempt()
        # Every rank's node, host and address in this attempt: what names a node that does not come back.
        places = gather_objects(rank_place())
        if session.is_main:
            record_layout(session.output_dir, places)
        # on_nonfinite: the step reports its loss and gradient-norm flags to this guard through the optimizer.
        self._check_disk(total_steps)
        # on_collapse: a run that learns nothing is decided by the same guard (each finding recorded, _report).
        guard = NonFiniteGuard(
            t.on_nonfinite,
            last_step=self.first_step - 1,
            last_good=self._last_good,
            on_collapse=t.on_collapse,
            report=self._report,
        )
        self.guard = attach(optimizer, guard)
        self.stop = StopRequest().install()
        # Preemption inside the kill window: a save that alone cannot fit is said now, with its figures.
        self.kill_window = KillWindow(
            window_s=cfg.restart.kill_window,
            checkpoint_bytes=self.checkpointer.checkpoint_bytes,
            world=session.world,
            save_steps=t.save_steps,
            save_async=t.save_async,
        )
        too_long = self.kill_window.at_start() if session.is_main else None
        if too_long:
            logger.warning("%s", too_long)

    def _take_previous_attempt(self) -> dict[str, Any] | None:
        """Rank 0: how the previous attempt ended (its ranks' records, the metrics it logged) into the run's
        restarts.json, and said in the log; None when this attempt follows no failure."""
        session = self.session
        if not session.is_main:
            return None
        logged = last_metrics(session.output_dir)
        entry = take_previous(
            session.output_dir,
            launch=session.launch,
            resumed_step=self.first_step - 1,
            last_logged_step=int(logged["step"]) if logged else 0,
            world=session.world,
        )
        if entry is not None:
            history = read_history(session.output_dir)
            logger.warning("%s", describe_restart(entry, history, session.launch))
        return entry

    def _fingerprint(self) -> dict[str, str]:
        """Fingerprints of the run's local data files (training and eval sources)."""
        d = self.session.cfg.data
        sources = resolve_sources(
            dataset_name=d.dataset_name,
            dataset_config_name=d.dataset_config_name,
            dataset_split=d.dataset_split,
            dataset_revision=d.dataset_revision,
            dataset_mixture=d.dataset_mixture,
        )
        return data_fingerprint(
            [s.name for s in sources]
            + ([parse_source(d.eval_dataset_name).name] if d.eval_dataset_name else [])
        )

    def _check_disk(self, total_steps: int) -> None:
        """The run folder's disk against one checkpoint (error) and all the run plans to write (warning); rank 0
        measures, every rank raises."""
        t, e = self.session.cfg.train, self.session.cfg.export
        one = checkpoint_bytes(self.model)
        self.checkpointer.checkpoint_bytes = one
        result = None
        if self.session.is_main:
            n = planned_checkpoints(
                self.first_step, total_steps or self.first_step, t.save_steps, t.save_total_limit
            )
            result = check_disk_space(
                self.session.output_dir,
                checkpoint=one,
                checkpoints=n,
                export=export_bytes(self.model, e.export_dtype),
            )
        error, warning = broadcast_object(result) or (None, None)
        if error:
            raise CheckpointError(error)
        if warning and self.session.is_main:
            logger.warning("%s", warning)

    def _last_good(self, before: int | None = None) -> str:
        """Where a stopped run continues from (every rank: finishes a save in flight). ``before``: the newest
        checkpoint at or before that step is the good one (a collapse: later ones hold the collapsed state)."""
        try:
            self.checkpointer.wait()
        except CheckpointError as err:
            logger.error("%s", err)
        saved = list_checkpoints(self.session.output_dir)
        good = [c for c in saved if before is None or _step_of(c) <= before]
        spoiled = [c.name for c in saved if c not in good]
        later = f" ({', '.join(spoiled)} hold the state it stopped on)" if spoiled else ""
        if not good:
            return f"No checkpoint was saved before {'it' if before is None else 'the collapse'}{later}. "
        how = "latest" if not spoiled else str(good[-1])
        return (
            f"The last good checkpoint is {good[-1]}{later}: continue from it with --resume_from_checkpoint {how} "
            "after the change. "
        )

    def _report(self, finding: Finding) -> None:
        """A run that learned nothing (every rank): rank 0 appends it to metrics.jsonl at once (a stopped run has
        no other record of it); a run stopped on it also gets a summary.json saying so. The guard keeps it for the
        end's summary and model card."""
        if not self.session.is_main:
            return
        append_metrics_event(self.session.output_dir, finding.record())
        if finding.action == "stopped":
            write_summary(
                {
                    "stopped": finding.kind,
                    "first_step": self.first_step,
                    "last_step": finding.step,
                    "export_dir": None,
                    "learned_nothing": [finding.record()],
                },
                self.session.output_dir,
            )

    def _resume(self, value: str) -> None:
        session, t = self.session, self.session.cfg.train
        path = resolve_resume(session.output_dir, value)
        saved_cfg = yaml.safe_load((path / CONFIG_FILE).read_text())
        saved_state = TrainerState.from_json((path / STATE_FILE).read_text())
        worlds = (saved_state.data_world or saved_state.world_size, session.data_world)
        try:
            notes = check_config_compatible(saved_cfg, session.cfg.to_flat_dict(), worlds)
        except CheckpointError as err:
            if not session.resume_auto:
                raise
            raise CheckpointError(  # auto found it in output_dir: another run's, not a changed one
                f"resume_from_checkpoint=auto: {path} is another run's checkpoint, not this run's ("
                f"{str(err).split(': ', 2)[-1].split('. Restore', 1)[0]}); choose another output_dir for this run, "
                "or restore those values to continue that one"
            ) from None
        for note in notes:
            logger.info("resuming with a changed setting: %s", note)
        state = self.checkpointer.load(path, self.model, self.optimizer)
        if state.run_id:
            self.checkpointer.run_id = state.run_id
        changed = changed_files(state.data_files, self.data_files) if session.is_main else []
        if changed:
            logger.warning(
                "resuming %s with data files changed since it was written: %s. The restored data position (epoch "
                "%d, batch %d) now points into other data: examples may be skipped or seen twice. Restore the files "
                "to resume exactly, or start a new run",
                path.name,
                "; ".join(changed[:5]),
                state.epoch,
                state.batches_in_epoch,
            )
        restore_scheduler(self.scheduler, state.scheduler, t.learning_rate, t.muon_lr)
        self.first_step, self.last_saved = state.step + 1, state.step
        # The data position in examples of the epoch; with another world size or batch size the same
        # number of examples is skipped, in the new layout (see docs: resume on a different world size).
        examples = (
            state.batches_in_epoch
            * state.per_device_train_batch_size
            * (state.data_world or state.world_size)
        )
        per_batch = t.per_device_train_batch_size * session.data_world
        if hasattr(self.stream, "load_state_dict"):  # a streamed corpus: each rank's own position
            if self.checkpointer.rank_data is None:
                raise CheckpointError(
                    f"{path} was written by {state.world_size} ranks; a streamed corpus resumes on the same number "
                    f"of ranks (each reads its own slice), not {session.world}"
                )
            self.stream.load_state_dict(self.checkpointer.rank_data)
        else:
            self.stream.start_at(state.epoch, examples // per_batch)
        buffer = (self.checkpointer.rank_data or {}).get("buffer")
        if self.step is not None and buffer is not None:
            self.step.load_buffer(buffer)
        if (state.data_world or state.world_size) != session.data_world or examples % per_batch:
            logger.warning(
                "resuming on %d ranks from a checkpoint of %d: weights and optimizer state are the same, the "
                "order of the remaining examples of this epoch is not",
                session.world,
                state.world_size,
            )
        logger.info(
            "resumed from %s at step %d (epoch %d, batch %d)",
            path,
            state.step,
            self.stream.epoch,
            self.stream.batches_in_epoch,
        )

    def save(self, step: int) -> None:
        """Write ``checkpoint-<step>`` (every rank; collective); never of a state after a non-finite step (stop)."""
        t = self.session.cfg.train
        self.guard.settle_now()  # a save reads the device anyway: the last step's flags first
        state = TrainerState(
            step=step,
            epoch=self.stream.epoch,
            batches_in_epoch=self.stream.batches_in_epoch,
            world_size=self.session.world,
            data_world=self.session.data_world,
            scheduler=self.scheduler.state_dict(),
            per_device_train_batch_size=t.per_device_train_batch_size,
            gradient_accumulation_steps=t.gradient_accumulation_steps,
            run_id=self.checkpointer.run_id,
            data_files=self.data_files,
        )
        rank_data = self.stream.state_dict() if hasattr(self.stream, "state_dict") else None
        buffer = self.step.buffer_state() if self.step is not None else None
        if buffer is not None:  # this rank's buffer across steps, beside its data position
            rank_data = {**(rank_data or {}), "buffer": buffer}
        started = time.perf_counter()
        with PROGRESS.unwatched("checkpoint save"):
            self.checkpointer.save(step, self.model, self.optimizer, state, self.config_yaml, rank_data)
        self.kill_window.saved(time.perf_counter() - started)
        self.last_saved = step
        if self.pusher is not None:
            self.pusher.push_new()

    def after_step(self, step: int, total_steps: int) -> bool:
        """Save on the cadence (every ``save_steps`` and at the last step); True when the run must stop now
        (SIGTERM on any rank: the state is saved first). Every rank calls it at every step."""
        t = self.session.cfg.train
        if step == total_steps:
            self.guard.settle_now()  # the last step's flags, before the end's save and export
        if t.save_steps and (step % t.save_steps == 0 or step == total_steps):
            self.save(step)
        if self.stop.should_stop():  # every rank: SIGTERM on any rank stops all at this step boundary
            if self.last_saved != step:
                self.save(step)
            self.checkpointer.wait()
            logger.warning(
                "SIGTERM: saved checkpoint-%d and stopped %.1f s after the signal (kill_window %g s); continue with "
                "--resume_from_checkpoint latest",
                step,
                self.stop.seconds_since(),  # every rank: the earliest signal
                self.session.cfg.restart.kill_window,
            )
            return True
        # Whether a SIGTERM can still end in a checkpoint before the SIGKILL, once the steps are measured (rank 0).
        said = (
            self.kill_window.check([*PROGRESS.durations, PROGRESS.snapshot()[2]])
            if self.session.is_main
            else None
        )
        if said is not None:
            (logger.info if said[0] else logger.warning)("%s", said[1])
        return False

    def ensure_saved(self, step: int) -> str:
        """The final state as a checkpoint, written unless it exists (every rank); returns its folder."""
        final = checkpoint_dir(self.session.output_dir, step)
        if not (final / STATE_FILE).is_file():
            self.save(step)
            self.checkpointer.wait()
        return str(final)

    def wait(self) -> None:
        """Finish pending saves and uploads of checkpoints (every rank)."""
        with PROGRESS.unwatched("checkpoint save"):
            self.checkpointer.wait()
        if self.pusher is not None:
            self.pusher.push_new()
