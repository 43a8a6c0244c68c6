"""The end of a run: the verified export (full model, or LoRA adapter and merge), the summary, the benchmarks
(``eval_harness_tasks``, rank 0), the push.

A failure of the export (a rejected verification, a full disk, a bug) never loses the run: the final state is
first saved as a sharded checkpoint (every rank: export failures are raised on every rank), and the error
says how to export it offline. The hub push runs on rank 0 alone once the other ranks are released (an
upload can outlast any collective timeout); a failed push leaves the local export as it is.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import torch

from hf_fsdp2 import collectives
from hf_fsdp2.checkpoint.layout import CheckpointError
from hf_fsdp2.composite import composite_spec
from hf_fsdp2.config import ConfigError, parse_size
from hf_fsdp2.elastic.agent import AgentLaunch, NodeLostError
from hf_fsdp2.elastic.attempts import ERROR, LOST, clear_attempt, read_history, record_end, with_restart_note
from hf_fsdp2.elastic.progress import PROGRESS
from hf_fsdp2.elastic.watchdog import wait_while_a_hang_is_named
from hf_fsdp2.export.card import render_model_card
from hf_fsdp2.export.errors import ExportError
from hf_fsdp2.export.hub import RUN_FOLDER_IGNORE, HubError, push_folder
from hf_fsdp2.export.source import ExportSource
from hf_fsdp2.export.writer import export_model
from hf_fsdp2.harness.evaluate import evaluate_after_export
from hf_fsdp2.lora.adapter import LoraError
from hf_fsdp2.lora.save import export_lora
from hf_fsdp2.model import auto_class_name
from hf_fsdp2.observe.logs import last_metrics
from hf_fsdp2.observe.summary import format_summary, run_summary, write_summary
from hf_fsdp2.parallel.kernels import KernelError
from hf_fsdp2.run.build import TrainModel
from hf_fsdp2.run.method import Method
from hf_fsdp2.run.observer import Observer
from hf_fsdp2.run.session import Session
from hf_fsdp2.run.state import RunState
from hf_fsdp2.score_head import carries_score_head
from hf_fsdp2.train.nonfinite import CollapseError, NonFiniteError

logger = logging.getLogger("hf_fsdp2")

# What a recipe reports as bad input (exit status 2, one line); anything else is a bug (a traceback).
USER_ERRORS = (
    ConfigError,
    CheckpointError,
    ExportError,
    HubError,
    KernelError,
    LoraError,
    NonFiniteError,
    CollapseError,
    NodeLostError,
    FileNotFoundError,
    ValueError,
)


def export_run(
    session: Session,
    model: TrainModel,
    tokenizer: Any,
    state: RunState,
    last_step: int,
    recipe: str = "sft",
    recipe_title: str | None = None,
) -> None:
    """The consolidated export in the run folder, written by every rank (none gathers the model), verified
    against the live model, then published; a model card from the run. Every rank calls it.

    Raises:
        ExportError: the export failed; the final state was saved first and the message says where.
    """
    cfg, e = session.cfg, session.cfg.export
    module = model.module
    unwrapped = session.accelerator.unwrap_model(module)
    card = None
    if session.is_main:
        card = render_model_card(
            cfg.to_flat_dict(),
            metrics=last_metrics(session.output_dir),
            world_size=session.world,
            repo_id=e.hub_model_id if e.push_to_hub else None,
            recipe=recipe,
            recipe_title=recipe_title,
            reward=auto_class_name(unwrapped.config) == "AutoModelForSequenceClassification",
            remote_code=carries_score_head(unwrapped.config),
            learned_nothing=[f.message for f in state.guard.findings],
            image_text=composite_spec(unwrapped.config) is not None,
            restarts=read_history(session.output_dir),
        )
    try:
        with PROGRESS.unwatched("export"):  # long, and never a step that stopped advancing
            if (
                cfg.peft.use_peft
            ):  # the adapter in output_dir (as TRL), the merged model in output_dir/merged if asked
                export_lora(
                    module,
                    session.output_dir,
                    base_model=cfg.model.model_name_or_path or "",
                    tokenizer=tokenizer,
                    merge=cfg.peft.merge_adapter,
                    layer_cls_names=model.layer_cls,
                    mp_policy=session.accelerator.state.fsdp_plugin.mixed_precision_policy,
                    dtype=e.export_dtype,
                    max_shard_bytes=parse_size(e.max_shard_size),
                    compute_dtype=session.compute_dtype or torch.float32,
                    verify=e.export_verify,
                    verify_atol=e.export_verify_atol,
                    model_card=card,
                    is_main_process=session.is_main,
                    # The merged copy's frozen parts are carried from the base's files, at the run's revision.
                    source=ExportSource(cfg.model.model_name_or_path or "", cfg.model.model_revision),
                    experts=session.expert_meshes,  # the merged twin's experts split as the run's
                )
            else:
                export_model(
                    module,
                    session.output_dir,
                    config=unwrapped.config,
                    tokenizer=tokenizer,
                    generation_config=getattr(unwrapped, "generation_config", None),
                    dtype=e.export_dtype,
                    max_shard_bytes=parse_size(e.max_shard_size),
                    model_card=card,
                    verify=e.export_verify,
                    verify_atol=e.export_verify_atol,
                    compute_dtype=session.compute_dtype,
                    # What did not train and what the class does not load: carried from the checkpoint's files.
                    source=ExportSource(cfg.model.model_name_or_path or "", cfg.model.model_revision),
                )
    except Exception as err:  # whatever it was; a bug's traceback is kept, after the weights are safe
        saved = state.ensure_saved(last_step)
        rescue = (
            f"The trained weights are safe in {saved} (a sharded checkpoint). Export them offline with: "
            f"hf-fsdp2 export {saved} OUT_DIR"
        )
        if isinstance(err, (ExportError, LoraError, OSError)):
            raise ExportError(f"{err}\n{rescue}") from err
        logger.error("the export failed: %s", rescue)
        raise


def finish(
    session: Session,
    model: TrainModel,
    tokenizer: Any,
    state: RunState,
    observer: Observer,
    *,
    first_step: int,
    last_step: int,
    method: Method,
) -> None:
    """Wait for checkpoints, export, write the summary, release the ranks, push (every rank calls it)."""
    e = session.cfg.export
    state.wait()
    observer.close()
    recipe = method.name
    export_run(session, model, tokenizer, state, last_step, recipe, method.title)
    # SIGTERM (on any rank) during the export: the export was let finish; the run ends as a clean stop.
    stopped = state.stop.should_stop()
    summary = run_summary(
        observer.meter,
        first_step=first_step,
        last_step=last_step,
        wall_seconds=time.perf_counter() - session.started,
        last_record=observer.record,
        last_eval=observer.eval_fields,
        export_dir=session.output_dir,
        compile_stats=observer.compile_totals if session.compile_plan.enabled else None,
        learned_nothing=[f.record() for f in state.guard.findings],
        restarts=read_history(session.output_dir) if session.is_main else [],
    )
    for line in format_summary(summary):
        logger.info(line)
    if session.is_main:
        write_summary(summary, session.output_dir)
        clear_attempt(session.output_dir)  # a finished run: no attempt left to explain
    session.accelerator.end_training()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if stopped:
        skipped = (
            f"; the hub push was skipped: push it with hf-fsdp2 push {session.output_dir} {e.hub_model_id}"
            if e.push_to_hub and e.hub_model_id
            else ""
        )
        logger.warning(
            "SIGTERM during the export: the export of step %d finished%s in %s%s; the run is complete (nothing to "
            "resume), stopping cleanly",
            last_step,
            " and was verified" if e.export_verify else "",
            session.output_dir,
            skipped,
        )
    if session.is_main and e.eval_harness_tasks and not stopped:  # rank 0 alone: the others are released
        evaluate_after_export(session.output_dir, e.eval_harness_tasks, limit=e.eval_harness_limit)
    if session.is_main and e.push_to_hub and e.hub_model_id and not stopped:
        push_folder(
            session.output_dir,
            e.hub_model_id,
            token=session.hub_token,
            private=e.hub_private_repo,
            revision=e.hub_revision,
            commit_message=e.hub_commit_message or f"hf_fsdp2 {recipe}: {last_step} steps",
            ignore_patterns=RUN_FOLDER_IGNORE,
        )
    if state.pusher is not None:
        state.pusher.wait()  # raises HubError naming each checkpoint whose upload failed


def run_recipe(main: Any) -> None:
    """Run a recipe's ``main()`` as a script: bad input is one clear line (rank 0) and exit status 2.

    Every rank raised the same error (the library agrees failures across ranks); rank 0 says it once.
    ``HF_FSDP2_DEBUG=1`` shows the traceback. After a successful run the process leaves without interpreter
    finalization: on gloo, C++ worker threads can still hold tensors of finished collectives whose
    destruction during finalization aborts the process (SIGABRT, "terminate called without an active
    exception") after a successful run; pytorch/pytorch#179291 describes it.
    """
    try:
        main()
    except USER_ERRORS as err:
        wait_while_a_hang_is_named()  # the watchdog ends the rank when the error comes from a hang it names
        # How this rank ended, for the attempt the launcher may start next (restarts.json), and whether one will.
        record_end(ERROR, str(err))
        if os.environ.get("HF_FSDP2_DEBUG"):
            raise
        if os.environ.get("RANK", "0") == "0":
            _say(with_restart_note(str(err), AgentLaunch.from_env(), PROGRESS.output_dir), 2)
        # No rank exits before rank 0 has said it: an early exit makes the launcher kill rank 0 mid-report.
        # No group to meet in (a refusal before one exists): every rank raised the same error, each when its own
        # start-up got there. Rank 0 has said it and leaves; the others wait for the launcher to end them when it
        # sees rank 0 leave: a rank leaving first would make the launcher kill rank 0 before it has said it (a fixed
        # short wait lost that race on a loaded machine). A single process waits for no one.
        alone = int(os.environ.get("WORLD_SIZE", "1")) == 1
        if not collectives.gather_before_exit() and not alone and os.environ.get("RANK", "0") != "0":
            time.sleep(60.0)
        leave(2)
    except Exception as err:
        wait_while_a_hang_is_named()
        # Another rank's process ended mid-collective (kill -9, the OOM killer, a crash): the transport's error names
        # an address, and its traceback the line of the collective; said in one line naming the rank where known.
        lost = None if os.environ.get("HF_FSDP2_DEBUG") else collectives.peer_lost(err)
        if lost is None:
            record_end(ERROR, f"{type(err).__name__}: {err}")
            note = with_restart_note("", AgentLaunch.from_env(), PROGRESS.output_dir).lstrip(". ")
            if note:  # before the traceback that follows
                print(f"hf_fsdp2: {note}", file=sys.stderr, flush=True)
            raise
        where, gone = lost
        record_end(LOST, f"lost {gone or 'a peer'}", gone=gone, where=where)
        me, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        # The lowest rank still running says it (rank 0 may be the one that ended); no waiting for the others:
        # a rank is gone, so the group cannot meet, and a destroy could wait on it.
        if me == min(set(range(world)) - set(gone), default=me):
            _say(
                with_restart_note(
                    collectives.peer_lost_message(where, gone, me),
                    AgentLaunch.from_env(),
                    PROGRESS.output_dir,
                ),
                1,
                "names, under Root Cause, the rank it saw end first (the lost rank, or one that lost it) and its exit "
                "code; its traceback can be ignored",
            )
        leave(1, destroy=False)
    leave(0)


def _say(message: str, status: int, report: str = "only repeats that status and can be ignored") -> None:
    """The rank's one error line (and, under a bare accelerate launch / torchrun, the note before it, which says
    what the launcher's ``report`` that follows adds)."""
    # A bare accelerate launch / torchrun prints its own traceback after this: said first, in one line. hf-fsdp2
    # train's launcher does not (HF_FSDP2_QUIET_LAUNCH: hf_fsdp2.launch.QUIET_LAUNCH_ENV).
    if os.environ.get("TORCHELASTIC_RUN_ID") and not os.environ.get("HF_FSDP2_QUIET_LAUNCH"):
        print(
            f"hf_fsdp2: the run stopped with exit status {status} on the error below; the launcher's report that "
            f"follows it (a traceback ending in ChildFailedError and a table of exit codes) {report}",
            file=sys.stderr,
        )
    print(f"hf_fsdp2 error: {message}", file=sys.stderr, flush=True)


def leave(status: int, *, destroy: bool = True) -> None:
    """End this rank with ``status``: the process group destroyed (every rank raised the same agreed error, so none
    is in a collective; not with ``destroy=False``, after a rank was lost), then out without interpreter
    finalization, whose gloo threads can abort the process (SIGABRT) after the error was reported; the launcher
    then reports ``status`` of every rank, not an abort."""
    if destroy and torch.distributed.is_initialized():
        try:
            torch.distributed.destroy_process_group()
        except Exception as err:  # leaving anyway: the status is what the launcher needs
            logger.debug("destroy_process_group: %s", err)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
