"""The run folder: refusing a previous run, reusing the folder of a failed start, the ownership lock."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_fsdp2.checkpoint.run_dir import LOCK_NAME, RunLock, check_output_dir, previous_run
from hf_fsdp2.config import ConfigError


def test_accepts_missing_and_empty(tmp_path: Path) -> None:
    check_output_dir(tmp_path / "missing", overwrite=False)
    assert not (tmp_path / "missing").exists()  # it checks, it does not create
    (tmp_path / "empty").mkdir()
    check_output_dir(tmp_path / "empty", overwrite=False)


def test_refuses_a_previous_run_unless_overwrite_and_offers_resume_only_with_a_checkpoint(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError) as err:
        check_output_dir(run, overwrite=False)
    assert "metrics.jsonl" in str(err.value) and "overwrite_output_dir" in str(err.value)
    assert "resume_from_checkpoint" not in str(err.value)  # nothing to resume from
    (run / "checkpoint-2").mkdir()
    with pytest.raises(ConfigError, match="--resume_from_checkpoint latest"):
        check_output_dir(run, overwrite=False)
    check_output_dir(run, overwrite=True)
    check_output_dir(run, overwrite=False, resume=True)
    assert (run / "metrics.jsonl").exists()  # nothing deleted by the check


def test_a_folder_left_by_a_failed_start_is_reused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "tensorboard").mkdir(parents=True)
    (run / "hf_fsdp2_config.yaml").write_text("seed: 1\n")
    (run / "tensorboard" / "events.out").write_text("x")
    assert previous_run(run) == []
    check_output_dir(run, overwrite=False)


def test_refuses_a_file(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        check_output_dir(path, overwrite=True)


def test_lock_is_exclusive_and_released(tmp_path: Path) -> None:
    first, second = RunLock(tmp_path), RunLock(tmp_path)
    first.acquire()
    holder = json.loads((tmp_path / LOCK_NAME).read_text())
    assert holder["pid"] == os.getpid()
    with pytest.raises(ConfigError, match=rf"is in use by another run \(pid {os.getpid()} on"):
        second.acquire()
    first.release()
    assert not (tmp_path / LOCK_NAME).exists()
    second.acquire()
    second.release()


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    import socket

    (tmp_path / LOCK_NAME).write_text(
        json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout), "started": "x"})
    )
    lock = RunLock(tmp_path)
    lock.acquire()  # the pid is gone: stale
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": "another-host", "pid": 1, "started": "x"}))
    with pytest.raises(ConfigError, match="another-host.*delete"):
        RunLock(tmp_path).acquire()  # another host cannot be checked: refused, with the fix


def test_a_read_only_output_dir_is_refused_before_any_work(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    # A read-only file system refuses even root (file permissions would not): a read-only tmpfs.
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a read-only tmpfs here (needs root)")
    try:
        for target in (ro, ro / "run" / "nested"):
            with pytest.raises(ConfigError) as err:
                check_output_dir(target, overwrite=False)
            assert f"output_dir={str(target)!r} cannot be written" in str(err.value)
            assert "read-only file system" in str(err.value) and "choose a writable output_dir" in str(
                err.value
            )
        with pytest.raises(ConfigError, match="cannot be written .*Read-only file system"):
            RunLock(ro / "run").acquire()
    finally:
        subprocess.run(["umount", str(ro)], check=False)


def test_overwrite_removes_everything_the_previous_run_wrote_before_the_new_run_starts(
    tmp_path: Path,
) -> None:
    """A new run that fails before it saves anything never leaves the previous run's summary, card
    and weights beside its own config (a folder describing two runs); files no run writes are kept."""
    from hf_fsdp2.elastic.agent import ResumeSetting
    from hf_fsdp2.run.session import claim_output_dir

    run = tmp_path / "run"
    (run / "checkpoint-4").mkdir(parents=True)
    (run / "merged").mkdir()
    (run / "plots").mkdir()
    finished = [
        "latest",
        "summary.json",
        "metrics.jsonl",
        "README.md",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "samples.jsonl",
        "adapter_model.safetensors",
        "adapter_config.json",
        ".hf_fsdp2_export.json",
    ]
    for name in finished:
        (run / name).write_text("{}")
    (run / "hf_fsdp2_config.yaml").write_text("seed: 1\n")  # rewritten by the new run
    (run / "notes.txt").write_text("mine")  # not a run's: kept
    lock = RunLock(run)
    claim_output_dir(lock, ResumeSetting(resume=None, overwrite=True), {})
    lock.release()
    assert sorted(p.name for p in run.iterdir()) == ["hf_fsdp2_config.yaml", "notes.txt"]


def test_the_exports_verification_record_is_a_run_output() -> None:
    """The record an export writes (push checks it) goes with the export it describes when a folder is overwritten."""
    from hf_fsdp2.checkpoint.run_dir import RUN_OUTPUTS
    from hf_fsdp2.export.folder import RECORD_NAME

    assert RECORD_NAME in RUN_OUTPUTS
