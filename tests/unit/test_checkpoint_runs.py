"""Checkpoints of different runs in one folder never mix: retention counts only the run's own checkpoints and
never deletes the one ``latest`` names; resume refuses a checkpoint of another run than ``latest``'s; an
overwritten folder loses the previous run's checkpoints first."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hf_fsdp2.checkpoint.checkpointer import Checkpointer
from hf_fsdp2.checkpoint.layout import CONFIG_FILE, STATE_FILE, CheckpointError, TrainerState
from hf_fsdp2.checkpoint.resume import resolve_resume, run_id_of
from hf_fsdp2.checkpoint.run_dir import clear_previous_run


def _checkpoint(out: Path, step: int, run_id: str) -> Path:
    """A real (tiny, single-process) DCP checkpoint of ``run_id`` at ``step``."""
    path = out / f"checkpoint-{step}"
    dcp.save({"model": {"w": torch.full((4,), float(step))}}, checkpoint_id=str(path))
    state = TrainerState(
        step=step,
        epoch=0,
        batches_in_epoch=step,
        world_size=1,
        scheduler={},
        per_device_train_batch_size=1,
        gradient_accumulation_steps=1,
        run_id=run_id,
    )
    (path / STATE_FILE).write_text(state.to_json())
    (path / CONFIG_FILE).write_text("seed: 1\n")
    return path


def _names(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob("checkpoint-*"))


def test_retention_keeps_the_new_runs_checkpoint_not_an_older_runs_higher_step(tmp_path: Path) -> None:
    # An older 6-step run's checkpoint-6 beside the new run's checkpoint-3, save_total_limit 1: sorted by step alone,
    # retention would keep the older run's and delete the new run's own.
    _checkpoint(tmp_path, 6, "old")
    _checkpoint(tmp_path, 3, "new")
    (tmp_path / "latest").write_text("3\n")
    ckpt = Checkpointer(tmp_path, keep_last=1, async_save=False, is_main_process=True)
    ckpt.run_id = "new"
    ckpt._prune(3)
    assert _names(tmp_path) == [
        "checkpoint-3",
        "checkpoint-6",
    ]  # the run's own, and the other run's untouched


def test_retention_keeps_the_last_k_of_the_run_and_the_one_latest_names(tmp_path: Path) -> None:
    for step in (1, 2, 3, 5):  # 5: a later checkpoint of a branch abandoned by resuming checkpoint-2
        _checkpoint(tmp_path, step, "r")
    ckpt = Checkpointer(tmp_path, keep_last=1, async_save=False, is_main_process=True)
    ckpt.run_id = "r"
    ckpt._prune(3)
    assert _names(tmp_path) == ["checkpoint-3", "checkpoint-5"]


def test_run_id_is_written_and_read_and_older_states_load(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path, 2, "abc")
    assert run_id_of(path) == "abc"
    assert (
        TrainerState.from_json(json.dumps({**json.loads((path / STATE_FILE).read_text()), "x": 1})).run_id
        == "abc"
    )
    older = {
        "step": 1,
        "epoch": 0,
        "batches_in_epoch": 1,
        "world_size": 1,
        "scheduler": {},
        "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": 1,
    }
    assert TrainerState.from_json(json.dumps(older)).run_id == ""


def test_resume_refuses_a_checkpoint_of_another_run_than_latests(tmp_path: Path) -> None:
    old = _checkpoint(tmp_path, 6, "oldrun")
    _checkpoint(tmp_path, 3, "newrun")
    (tmp_path / "latest").write_text("3\n")
    assert resolve_resume(tmp_path, "latest") == tmp_path / "checkpoint-3"
    with pytest.raises(CheckpointError) as err:
        resolve_resume(tmp_path, str(old))
    assert (
        "run oldrun" in str(err.value) and "run newrun" in str(err.value) and "checkpoint-3" in str(err.value)
    )


def test_latest_never_falls_back_to_another_runs_checkpoint(tmp_path: Path, caplog) -> None:
    _checkpoint(tmp_path, 6, "oldrun")
    new = _checkpoint(tmp_path, 3, "newrun")
    (tmp_path / "latest").write_text("3\n")
    (new / ".metadata").write_bytes(b"garbage")  # the run's own checkpoint is damaged
    with caplog.at_level(logging.WARNING, logger="hf_fsdp2"), pytest.raises(CheckpointError) as err:
        resolve_resume(tmp_path, "latest")
    assert "of the run 'latest' names" in str(err.value)
    assert "written by run oldrun, not by run newrun" in caplog.text


def test_latest_naming_a_missing_checkpoint_is_refused_not_replaced_by_another(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 6, "oldrun")
    (tmp_path / "latest").write_text("3\n")  # latest names a checkpoint that was deleted
    with pytest.raises(CheckpointError) as err:
        resolve_resume(tmp_path, "latest")
    assert "names checkpoint-3, which does not exist" in str(err.value) and "checkpoint-6" in str(err.value)


def test_overwriting_a_folder_removes_the_previous_runs_checkpoints_first(tmp_path: Path, caplog) -> None:
    for step in (2, 4):
        _checkpoint(tmp_path, step, "old")
    (tmp_path / ".tmp-checkpoint-6").mkdir()
    (tmp_path / "latest").write_text("4\n")
    (tmp_path / "model.safetensors").write_bytes(b"x")  # the previous run's export goes too
    (tmp_path / "checkpoint-notes").mkdir()  # not a checkpoint: kept
    elsewhere = _checkpoint(tmp_path / "other", 8, "old")
    (tmp_path / "checkpoint-8").symlink_to(
        elsewhere, target_is_directory=True
    )  # the link goes, not its target
    with caplog.at_level(logging.WARNING, logger="hf_fsdp2"):
        removed = clear_previous_run(tmp_path)
    assert removed == [
        ".tmp-checkpoint-6",
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-8",
        "latest",
        "model.safetensors",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-notes", "other"]
    assert (elsewhere / "trainer_state.json").is_file()
    assert "removed the previous run's checkpoints" in caplog.text


def test_a_damaged_config_or_trainer_state_is_named_not_a_traceback(tmp_path: Path) -> None:
    from hf_fsdp2.checkpoint.resume import checkpoint_problems

    path = _checkpoint(tmp_path, 2, "r")
    (path / CONFIG_FILE).write_text("model_name_or_path: [unclosed\n  x: : :\n")
    assert checkpoint_problems(path) == [
        "hf_fsdp2_config.yaml is not valid YAML (line 2: expected ',' or ']', but got ':')"
    ]
    (path / CONFIG_FILE).write_bytes(b"\xff\xfe\x00binary")
    assert checkpoint_problems(path)[0].startswith("hf_fsdp2_config.yaml is not text (byte 0")
    (path / CONFIG_FILE).write_text("seed: 1\n")
    (path / STATE_FILE).write_text('{"step": 2,')
    assert checkpoint_problems(path)[0].startswith("trainer_state.json is not valid JSON (")


@pytest.mark.parametrize("then, now", [("true", "false"), ("false", "true")])
def test_resume_refuses_a_changed_load_in_4bit_naming_the_key(tmp_path: Path, then: str, now: str) -> None:
    """A QLoRA checkpoint resumed without --load_in_4bit used to go on training its adapter over the
    full-precision base with an INFO line; refused now, naming the key, both values and the fix (and the reverse)."""
    import yaml

    from hf_fsdp2.checkpoint.resume import check_config_compatible
    from hf_fsdp2.config.parse import save_config
    from hf_fsdp2.methods import parse_method_config

    def config(load_in_4bit: str) -> dict:
        argv = ["--model_name_or_path", "m", "--dataset_name", "d.jsonl", "--output_dir", str(tmp_path)]
        return parse_method_config("sft", [*argv, "--use_peft", "true", "--load_in_4bit", load_in_4bit])

    # The checkpoint's config as the run writes it and the resume reads it back.
    saved = yaml.safe_load(save_config(config(then), tmp_path / CONFIG_FILE).read_text())
    assert check_config_compatible(saved, config(then).to_flat_dict()) == []
    with pytest.raises(CheckpointError) as err:
        check_config_compatible(saved, config(now).to_flat_dict())
    message = str(err.value)
    assert f"load_in_4bit: checkpoint {then.title()} vs now {now.title()}" in message
    assert f"resume with --load_in_4bit {then}" in message


def test_a_checkpoint_config_without_load_in_4bit_resumes_as_not_quantised() -> None:
    """Checkpoints written before the key was compared hold no load_in_4bit: read as false (no 4-bit run then)."""
    from hf_fsdp2.checkpoint.resume import check_config_compatible

    check_config_compatible({"seed": 1}, {"seed": 1, "load_in_4bit": False})
    with pytest.raises(CheckpointError, match="load_in_4bit: checkpoint False vs now True"):
        check_config_compatible({"seed": 1}, {"seed": 1, "load_in_4bit": True})
