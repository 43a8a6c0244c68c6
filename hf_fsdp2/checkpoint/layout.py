"""The folder a checkpoint is, its file names, and the trainer state it carries.

A checkpoint is the folder ``<output_dir>/checkpoint-<step>``::

    __0_0.distcp, ...       model + optimizer shards, one file per rank (no rank gathers the model)
    .metadata               DCP's index of the shards
    rng/rank<r>.pt          python, numpy and torch RNG states of every rank
    trainer_state.json      step, data position, scheduler state, world size (written last)
    hf_fsdp2_config.yaml    the resolved config of the run that wrote it
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

PREFIX = "checkpoint-"
TMP_PREFIX = ".tmp-checkpoint-"
LATEST = "latest"
STATE_FILE = "trainer_state.json"
PENDING_STATE_FILE = ".trainer_state.pending.json"
CONFIG_FILE = "hf_fsdp2_config.yaml"
README_FILE = "README.md"
# Beside the checkpoints in a run folder: how the ranks of a failed attempt ended (hf_fsdp2.elastic.attempts), and
# the run's restarts so far.
ATTEMPT_DIR = ".hf_fsdp2_attempt"
RESTARTS_FILE = "restarts.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or resumed; the message says why and what to do."""


@dataclass(kw_only=True)
class TrainerState:
    """Everything besides tensors that a resume needs."""

    step: int
    epoch: int
    batches_in_epoch: int
    world_size: int
    scheduler: dict[str, Any]
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    # The run that wrote it: a new id per run, kept across its resumes; retention and resume never mix runs.
    # "" in checkpoints written before run ids existed (they match any run).
    run_id: str = ""
    # What the local data files were when it was written (path -> size and content digest), to notice on resume
    # a file changed in place; empty for hub datasets (their revision is part of the config).
    data_files: dict[str, str] = field(default_factory=dict)
    # Ranks that read different batches (world / (cp x tp)); None in checkpoints written before context and tensor
    # parallel (their world size read the data).
    data_world: int | None = None

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=2)

    @classmethod
    def from_json(cls, text: str) -> TrainerState:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in json.loads(text).items() if k in known})


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / f"{PREFIX}{step}"


def _step_of(path: Path) -> int:
    return int(path.name[len(PREFIX) :])
