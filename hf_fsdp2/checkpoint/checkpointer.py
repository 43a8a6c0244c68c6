"""Sharded, atomic checkpoints with torch.distributed.checkpoint (DCP), and exact resume: the :class:`Checkpointer`.

A checkpoint (its files: :mod:`hf_fsdp2.checkpoint.layout`) is written under ``<output_dir>/.tmp-checkpoint-<step>``
and renamed into place by rank 0 only after every rank has finished writing; the ``latest`` file (a step number) is
replaced after that. A crash or kill -9 at any moment therefore leaves the previous checkpoint, and ``latest``, valid.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from hf_fsdp2 import collectives
from hf_fsdp2.checkpoint.layout import (
    CONFIG_FILE,
    LATEST,
    PENDING_STATE_FILE,
    README_FILE,
    STATE_FILE,
    TMP_PREFIX,
    CheckpointError,
    TrainerState,
    _step_of,
    checkpoint_dir,
)
from hf_fsdp2.checkpoint.manifest import default_algorithm, digest_files, rank_files, write_manifest
from hf_fsdp2.checkpoint.resume import checkpoint_problems, latest_checkpoint, list_checkpoints, run_id_of
from hf_fsdp2.checkpoint.space import out_of_space_note

logger = logging.getLogger("hf_fsdp2")


# What a checkpoint holds of the model: what trains. A frozen base (LoRA, QLoRA's 4-bit weights) is the model folder
# the run started from, loaded again on resume; full fine-tuning freezes nothing, so everything is saved.
_TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True)
# Loading it back leaves the frozen parameters as loaded (not strict about them); dcp.load has already refused a
# checkpoint that lacks any trained tensor the model asks for.
_INTO_TRAINED = StateDictOptions(ignore_frozen_params=True, strict=False)


def checkpoint_readme(step: int, world_size: int) -> str:
    """The README.md of ``checkpoint-<step>``: what the folder is and the commands that use it."""
    return f"""# checkpoint-{step}: a training checkpoint of hf_fsdp2 (not a Hugging Face model folder)

The model and optimizer state after step {step}, as PyTorch Distributed Checkpoint (DCP) shards written by
{world_size} rank(s), with the RNG state of every rank, the data position and the run's config
(`hf_fsdp2_config.yaml`). `from_pretrained` cannot open this folder.

- Turn it into a Hugging Face folder (safetensors, config, tokenizer; a LoRA run gives the adapter):

      hf-fsdp2 export {"checkpoint-" + str(step)} OUT_DIR

- Continue training from it (on any number of ranks):

      hf-fsdp2 train --config RECIPE.yaml --resume_from_checkpoint {"checkpoint-" + str(step)}   # or: latest
"""


def rng_state() -> dict[str, Any]:
    """This process's RNG states (python, numpy, torch CPU, and CUDA when present)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore states captured by :func:`rng_state`."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _fault_point(phase: str, step: int) -> None:
    """Fault injection for the crash tests: ``HF_FSDP2_FAULT=<phase>:<step>:<rank>`` makes that rank
    kill -9 itself at that point of the save of that step. Phases: ``kill_during_save`` (shards
    written, checkpoint not yet published) and ``kill_after_save`` (published)."""
    spec = os.environ.get("HF_FSDP2_FAULT", "")
    if spec.startswith(phase + ":"):
        _, fault_step, fault_rank = spec.split(":")
        if int(fault_step) == step and int(fault_rank) == collectives.rank():
            os.kill(os.getpid(), signal.SIGKILL)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Checkpointer:
    """Saves and loads sharded checkpoints of one run; holds the pending async save, if any.

    Every rank creates one and calls :meth:`save` at the same steps (collective).
    """

    def __init__(
        self, output_dir: str | Path, *, keep_last: int, async_save: bool, is_main_process: bool
    ) -> None:
        self.output_dir = Path(output_dir)
        self.keep_last = keep_last
        self.async_save = async_save
        self.is_main = is_main_process
        self.protected: Path | None = None  # the checkpoint resumed from is never deleted
        self.run_id = ""  # this run's identity (set by the run); retention counts only its checkpoints
        self.checkpoint_bytes = 0  # about what one checkpoint takes (set by the run), to name a full disk
        self.rank_data: dict[str, Any] | None = None  # this rank's data position, from the checkpoint loaded
        self._pending: tuple[Future, Path, Path, int] | None = None
        self._algorithm = default_algorithm()  # of the manifest's digests
        self._digests: dict[str, dict[str, Any]] = {}  # this rank's files of the save in flight
        self._async_group: Any = None
        if async_save and dist.is_initialized():
            # A separate gloo group, so the background writer's collectives never interleave with
            # the training collectives on the default group. Every rank takes part.
            self._async_group = dist.new_group(backend="gloo")

    def clean_stale(self) -> None:
        """Remove temporary folders of saves that never completed (rank 0; call before training)."""
        if self.is_main and self.output_dir.is_dir():
            for p in self.output_dir.iterdir():
                if p.name.startswith(TMP_PREFIX):
                    logger.warning("removing %s: an interrupted checkpoint save", p)
                    shutil.rmtree(p, ignore_errors=True)
        collectives.barrier()

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        state: TrainerState,
        config_yaml: str,
        rank_data: dict[str, Any] | None = None,
    ) -> None:
        """Write ``checkpoint-<step>`` (every rank; collective).

        ``rank_data`` is this rank's own data position (a streamed corpus: each rank reads its own slice),
        saved beside its RNG state.

        Raises:
            CheckpointError: writing failed (disk full, permissions...); the temporary folder is
                removed and the previous checkpoint and ``latest`` stay as they were.
        """
        self.wait()  # at most one save in flight
        final = checkpoint_dir(self.output_dir, step)
        tmp = self.output_dir / f"{TMP_PREFIX}{step}"

        def prepare_folder() -> None:
            if self.is_main:
                if tmp.exists():
                    shutil.rmtree(tmp)
                (tmp / "rng").mkdir(parents=True)

        def write() -> None:
            torch.save({**rng_state(), "data": rank_data}, tmp / "rng" / f"rank{collectives.rank()}.pt")
            tensors = {
                "model": get_model_state_dict(model, options=_TRAINED_ONLY),
                "optim": get_optimizer_state_dict(model, optimizer),
            }
            if self.is_main:
                (tmp / CONFIG_FILE).write_text(config_yaml)
                (tmp / README_FILE).write_text(checkpoint_readme(step, state.world_size))
            if self.async_save:
                future = dcp.async_save(tensors, checkpoint_id=str(tmp), process_group=self._async_group)
                if self.is_main:
                    (tmp / PENDING_STATE_FILE).write_text(state.to_json())
                self._pending = (future, tmp, final, step)  # type: ignore[assignment]
                return
            dcp.save(tensors, checkpoint_id=str(tmp))  # collective
            self._digests = digest_files(tmp, rank_files(tmp, collectives.rank()), self._algorithm)
            if self.is_main:  # _publish puts it in place as trainer_state.json, after the manifest
                (tmp / PENDING_STATE_FILE).write_text(state.to_json())

        # Each phase ends with every rank agreeing on success, so a failure on one rank never
        # leaves the others waiting in a collective the failed rank skipped.
        self._agree(prepare_folder, step, tmp)
        self._agree(write, step, tmp)
        _fault_point("kill_during_save", step)
        if not self.async_save:
            self._publish(tmp, final, step)

    def _agree(self, phase: Callable[[], None], step: int, tmp: Path) -> None:
        """Run ``phase`` on every rank; if it fails anywhere, clean up and raise on every rank."""
        try:
            collectives.run_on_all(f"saving checkpoint-{step}", phase, CheckpointError)
        except CheckpointError as err:
            self._pending = None
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(self._failure_text(str(err), step)) from None

    def _failure_text(self, error: str, step: int) -> str:
        """What failed (in one line), a full disk named as such, and truthfully what exists to continue from."""
        full = out_of_space_note(self.output_dir, self.checkpoint_bytes, error)
        error = gist(error)
        try:
            previous = latest_checkpoint(self.output_dir)
        except CheckpointError:
            previous = None
        if previous is not None and (previous / STATE_FILE).is_file():
            kept = f"the previous checkpoint {previous.name} and 'latest' are kept"
            then = "resume with --resume_from_checkpoint latest"
        else:
            kept = f"no earlier checkpoint of this run exists, so the state of step {step} is not saved"
            then = "run again"
        fix = (
            "Free space on that disk (or lower save_total_limit)"
            if full
            else "Free disk space or fix permissions"
        )
        return f"{error}{'; ' + full if full else ''}; {kept}. {fix}, then {then}"

    def wait(self) -> None:
        """Finish a pending async save and publish it (every rank)."""
        if self._pending is None:
            return
        future, tmp, final, step = self._pending

        def finish() -> None:
            future.result()  # the writer thread's error, if any, surfaces here
            self._digests = digest_files(tmp, rank_files(tmp, collectives.rank()), self._algorithm)

        self._agree(finish, step, tmp)
        self._pending = None
        self._publish(tmp, final, step)

    def _publish(self, tmp: Path, final: Path, step: int) -> None:
        collectives.barrier()  # every rank has written its shard files
        self._seal(tmp, step)

        def check() -> None:  # rank 0: never publish a checkpoint without all its files
            if self.is_main:
                problems = checkpoint_problems(tmp, digests=False)
                if problems:
                    raise CheckpointError(f"the written files are incomplete: {'; '.join(problems[:3])}")

        self._agree(check, step, tmp)
        if self.is_main:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _write_text_atomic(self.output_dir / LATEST, f"{step}\n")
            self._prune(step)
            logger.info("saved %s", final)
        collectives.barrier()
        _fault_point("kill_after_save", step)

    def _prune(self, step: int) -> None:
        """Keep this run's last ``keep_last`` checkpoints up to ``step`` (the one ``latest`` now names).

        Only checkpoints of this run (same run id) count: another run's are never deleted in place of this
        run's, nor kept instead of them. Those after ``step`` (a branch abandoned by resuming an earlier
        checkpoint) are left to be replaced; the checkpoint resumed from is kept.
        """
        if self.keep_last <= 0:
            return
        mine = [
            p
            for p in list_checkpoints(self.output_dir)
            if _step_of(p) <= step and run_id_of(p) == self.run_id
        ]
        for old in mine[: -self.keep_last]:
            if _step_of(old) == step:
                continue  # the checkpoint 'latest' names
            if self.protected is not None and old.resolve() == self.protected.resolve():
                continue
            shutil.rmtree(old, ignore_errors=True)
            logger.info("removed %s (keeping the last %d)", old.name, self.keep_last)

    def _seal(self, tmp: Path, step: int) -> None:
        """The manifest of the written files (each rank hashed its own), then ``trainer_state.json``, which marks
        the checkpoint complete: a checkpoint is never complete without its manifest (every rank)."""
        written = collectives.gather_objects(self._digests)  # every rank (host group)
        self._digests = {}

        def seal() -> None:
            if self.is_main:
                files = {name: entry for part in written for name, entry in part.items()}
                shared = [n for n in (".metadata", CONFIG_FILE, README_FILE) if (tmp / n).is_file()]
                files.update(digest_files(tmp, shared, self._algorithm))
                pending = digest_files(tmp, [PENDING_STATE_FILE], self._algorithm)
                files[STATE_FILE] = pending[PENDING_STATE_FILE]
                write_manifest(tmp, files, self._algorithm)
                os.replace(tmp / PENDING_STATE_FILE, tmp / STATE_FILE)  # last: marks completeness

        self._agree(seal, step, tmp)

    def load(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainerState:
        """Load model and optimizer shards (resharded to the current world size) and this rank's RNG.

        Every rank takes part. RNG states are restored only when the world size is unchanged
        (rank r's file exists for every current rank); otherwise the ranks keep the run's seed.
        """
        state = TrainerState.from_json((path / STATE_FILE).read_text())
        model_sd = get_model_state_dict(model, options=_TRAINED_ONLY)
        optim_sd = get_optimizer_state_dict(model, optimizer)
        # DCP loads in place into these (sharded) state dicts, resharding to this world size.
        try:
            dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
        except (Exception, CheckpointException) as err:
            raise CheckpointError(
                f"cannot load the checkpoint {path}: {_first_line(err)}. Its files may be damaged: resume from an "
                "earlier checkpoint-<step>"
            ) from err
        set_model_state_dict(model, model_sd, options=_INTO_TRAINED)
        set_optimizer_state_dict(model, optimizer, optim_sd)
        rng_file = path / "rng" / f"rank{collectives.rank()}.pt"
        world = collectives.world()
        self.rank_data = None
        if state.world_size == world and rng_file.is_file():
            saved = torch.load(rng_file, weights_only=False)
            set_rng_state(saved)
            self.rank_data = saved.get("data")
        self.protected = path
        return state


def gist(error: str) -> str:
    """One line of a failure whose text holds every rank's traceback (DCP's CheckpointException): its first line
    up to the exception's name, then each distinct error line of the tracebacks."""
    lines = error.splitlines()
    if len(lines) <= 1:
        return error
    head = lines[0].split(" CheckpointException", 1)[0].rstrip(":") + ":"
    causes: list[str] = []
    for line in lines[1:]:
        is_error = (
            line and not line.startswith((" ", "Traceback")) and ("Error" in line or "Exception" in line)
        )
        if is_error and line.strip() not in causes:
            causes.append(line.strip())
    return f"{head} {'; '.join(causes[:2])}" if causes else lines[0]


def _first_line(err: BaseException) -> str:
    """The gist of an error (DCP wraps each rank's traceback into one long message)."""
    text = str(err)
    for line in text.splitlines():
        if "Error" in line and "Traceback" not in line:
            return line.strip()
    return text.splitlines()[0] if text else type(err).__name__
