"""A full disk: the space a run plans is checked at the start (warning with both numbers, an
error where one checkpoint cannot fit); a save that runs out of space names ENOSPC, the folder and the bytes a
checkpoint needs, and says truthfully what exists."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

import hf_fsdp2.checkpoint.checkpointer as checkpoint
from hf_fsdp2.checkpoint.checkpointer import Checkpointer
from hf_fsdp2.checkpoint.layout import CheckpointError, TrainerState
from hf_fsdp2.checkpoint.space import (
    check_disk_space,
    checkpoint_bytes,
    export_bytes,
    planned_checkpoints,
    size_text,
)

MIB = 1 << 20


def test_sizes_come_from_parameters_dtypes_and_adam_state() -> None:
    model = torch.nn.Linear(1024, 256, bias=False)  # 262144 fp32 parameters = 1 MiB
    assert checkpoint_bytes(model) == 3 * MIB  # weights + exp_avg + exp_avg_sq
    model.weight.requires_grad_(False)
    assert checkpoint_bytes(model) == MIB  # frozen: no optimizer state
    assert export_bytes(model, "bfloat16") == MIB // 2 and export_bytes(model, "training") == MIB


def test_planned_checkpoints_follow_save_steps_and_the_limit() -> None:
    assert planned_checkpoints(1, 10, 2, 0) == 5
    assert planned_checkpoints(1, 9, 2, 0) == 5  # 2, 4, 6, 8 and the last step
    assert planned_checkpoints(1, 10, 2, 2) == 3  # the new one is written before the oldest goes
    assert planned_checkpoints(7, 10, 2, 0) == 2  # resumed at step 7
    assert planned_checkpoints(1, 10, 0, 0) == 0


def test_a_disk_that_cannot_hold_one_checkpoint_is_an_error_and_a_short_one_a_warning(tmp_path: Path) -> None:
    error, warning = check_disk_space(
        tmp_path, checkpoint=50 * MIB, checkpoints=3, export=8 * MIB, free=20 * MIB
    )
    assert warning is None and error is not None
    assert "20.0 MiB free, one checkpoint needs about 50.0 MiB" in error and str(tmp_path) in error
    error, warning = check_disk_space(
        tmp_path, checkpoint=50 * MIB, checkpoints=3, export=8 * MIB, free=60 * MIB
    )
    assert error is None and warning is not None
    assert "60.0 MiB free" in warning and "about 158.0 MiB" in warning and "3 checkpoint(s)" in warning
    assert check_disk_space(tmp_path, checkpoint=MIB, checkpoints=3, export=MIB, free=60 * MIB) == (
        None,
        None,
    )
    # Without periodic checkpoints the first thing written is the export.
    error, _ = check_disk_space(tmp_path, checkpoint=50 * MIB, checkpoints=0, export=8 * MIB, free=4 * MIB)
    assert error is not None and "the export needs about 8.0 MiB" in error
    assert size_text(1.5 * (1 << 30)) == "1.50 GiB" and size_text(512) == "512 B"


def _save(tmp_path: Path, step: int) -> None:
    ckpt = Checkpointer(tmp_path, keep_last=0, async_save=False, is_main_process=True)
    ckpt.checkpoint_bytes = 50 * MIB
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    state = TrainerState(
        step=step,
        epoch=0,
        batches_in_epoch=step,
        world_size=1,
        scheduler={},
        per_device_train_batch_size=1,
        gradient_accumulation_steps=1,
        run_id="r",
    )
    ckpt.save(step, model, optimizer, state, "seed: 1\n")


def test_a_save_that_runs_out_of_space_names_it_and_says_no_checkpoint_exists(
    tmp_path: Path, monkeypatch
) -> None:
    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", full)
    with pytest.raises(CheckpointError) as err:
        _save(tmp_path, 6)
    text = str(err.value)
    assert "failed while saving checkpoint-6" in text and "ENOSPC" in text and str(tmp_path) in text
    assert "a checkpoint needs about 50.0 MiB" in text
    assert "no earlier checkpoint of this run exists" in text and "previous checkpoint" not in text
    assert not (tmp_path / ".tmp-checkpoint-6").exists()


def test_a_failed_save_after_a_good_one_names_the_checkpoint_that_is_kept(
    tmp_path: Path, monkeypatch
) -> None:
    _save(tmp_path, 2)

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", full)
    with pytest.raises(CheckpointError) as err:
        _save(tmp_path, 4)
    assert "the previous checkpoint checkpoint-2 and 'latest' are kept" in str(err.value)
    assert "--resume_from_checkpoint latest" in str(err.value)


def test_a_failure_holding_every_ranks_traceback_is_said_in_one_line() -> None:
    from hf_fsdp2.checkpoint.checkpointer import gist as _gist

    text = (
        "failed while saving checkpoint-4 (rank 0): CheckpointException: CheckpointException ranks:dict_keys([0, 1])\n"
        "Traceback (most recent call last): (RANK 0)\n"
        '  File "x.py", line 1, in f\n'
        "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598\n"
        "Traceback (most recent call last): (RANK 1)\n"
        '  File "x.py", line 1, in f\n'
        "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598\n"
    )
    assert _gist(text) == (
        "failed while saving checkpoint-4 (rank 0): RuntimeError: [enforce fail at inline_container.cc:672] . "
        "unexpected pos 704 vs 598"
    )
    assert _gist("one line") == "one line"
