"""2-rank gloo tests of sharded checkpoints: exact resume, world-size change, retention, kill -9
during a save, SIGTERM, config mismatch, and a full disk."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from support import launch
from support.launch import SFT, torchrun
from support.tiny import make_tiny_llama_dir, write_chat_jsonl

from hf_fsdp2.observe.logs import read_metrics

# 40 records, 2 ranks x batch 2 x accumulation 2: 10 micro-batches per rank per epoch, 5 steps an
# epoch; checkpoint-3 is mid-epoch (6 of 10 micro-batches), and steps 6-8 run in the second epoch.
COMMON = [
    "--max_steps",
    "8",
    "--per_device_train_batch_size",
    "2",
    "--gradient_accumulation_steps",
    "2",
    "--learning_rate",
    "3e-3",
    "--max_length",
    "96",
    "--mixed_precision",
    "no",
    "--seed",
    "11",
    "--warmup_steps",
    "2",
    "--export_dtype",
    "float32",
    # What these tests check is the checkpoint; the end-of-run export's verification (a fresh process that reloads
    # it, ~10 s a run) is tested where it is the subject (tests/unit/test_export*.py, test_verify_matrix.py).
    "--export_verify",
    "false",
]


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return make_tiny_llama_dir(root / "model", seed=6), write_chat_jsonl(root / "chat.jsonl", 40, seed=2)


def _args(assets: tuple[Path, Path], out: Path, *extra: str) -> list[str]:
    model, data = assets
    return [
        "--model_name_or_path",
        str(model),
        "--dataset_name",
        str(data),
        "--output_dir",
        str(out),
        *COMMON,
        *extra,
    ]


def _losses(out: Path) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(out / "metrics.jsonl")}


@pytest.fixture(scope="module")
def uninterrupted(assets, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("full") / "run"
    torchrun(SFT, _args(assets, out, "--save_steps", "3", "--save_total_limit", "0"))
    return out


@pytest.mark.parametrize("save_async", [False, True], ids=["sync", "async"])
def test_resume_mid_epoch_with_accumulation_gives_identical_losses(
    assets, uninterrupted: Path, tmp_path: Path, save_async: bool
):
    out = tmp_path / "run"
    # First leg: a rank is killed (-9) right after checkpoint-3 (mid-epoch) is published.
    os.environ["HF_FSDP2_FAULT"] = "kill_after_save:3:0"
    try:
        proc = torchrun(
            SFT, _args(assets, out, "--save_steps", "3", "--save_async", str(save_async).lower()), check=False
        )
    finally:
        del os.environ["HF_FSDP2_FAULT"]
    assert proc.returncode != 0 and (out / "latest").read_text().strip() == "3"
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    assert (state["epoch"], state["batches_in_epoch"]) == (0, 6)
    # Second leg: resume from latest with the full step count.
    torchrun(
        SFT,
        _args(
            assets,
            out,
            "--resume_from_checkpoint",
            "latest",
            "--save_steps",
            "3",
            "--save_async",
            str(save_async).lower(),
        ),
    )
    full, resumed = _losses(uninterrupted), _losses(out)
    assert sorted(resumed) == list(range(1, 9))
    for step in range(4, 9):
        assert resumed[step] == full[step], step  # identical, not merely close (CPU, fp32)


def test_resume_on_a_different_world_size_keeps_weights_and_optimizer(
    assets, uninterrupted: Path, tmp_path: Path
):
    worker = Path(__file__).parent / "workers" / "reshard_worker.py"
    model, _ = assets
    ckpt = uninterrupted / "checkpoint-6"
    dumps = {}
    for world in (2, 1):
        dump = tmp_path / f"world{world}.pt"
        torchrun(worker, ["--model", str(model), "--checkpoint", str(ckpt), "--dump", str(dump)], nproc=world)
        dumps[world] = dump
    import torch

    a, b = torch.load(dumps[2]), torch.load(dumps[1])
    assert a["model"].keys() == b["model"].keys() and len(a["model"]) > 10
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["optim_keys"] == b["optim_keys"] and a["optim_keys"]
    for k in a["optim"]:
        assert torch.equal(a["optim"][k], b["optim"][k]), k
    # The recipe resumes 2 -> 1 and 1 -> 2 and trains on.
    one = tmp_path / "one"
    torchrun(
        SFT,
        _args(
            assets,
            one,
            "--resume_from_checkpoint",
            str(ckpt),
            "--overwrite_output_dir",
            "true",
            "--save_steps",
            "7",
        ),
        nproc=1,
    )
    assert sorted(_losses(one)) == [7, 8]
    torchrun(
        SFT,
        _args(
            assets,
            tmp_path / "two",
            "--resume_from_checkpoint",
            str(one / "checkpoint-7"),
            "--save_steps",
            "0",  # no checkpoint-8: nothing resumes it (its losses and export are what is checked)
        ),
        nproc=2,
    )
    assert sorted(_losses(tmp_path / "two")) == [8]
    assert (tmp_path / "two" / "model.safetensors").is_file()


def test_retention_keeps_last_k_and_never_the_resumed_one(assets, uninterrupted: Path, tmp_path: Path):
    out = tmp_path / "run"
    torchrun(SFT, _args(assets, out, "--save_steps", "1", "--save_total_limit", "2", "--max_steps", "4"))
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    assert (out / "latest").read_text().strip() == "4"
    torchrun(
        SFT,
        _args(
            assets,
            out,
            "--resume_from_checkpoint",
            str(out / "checkpoint-3"),
            "--save_steps",
            "1",
            "--save_total_limit",
            "2",
            "--max_steps",
            "6",
        ),
    )
    # checkpoint-3 was resumed from: kept although it is older than the last two.
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [
        "checkpoint-3",
        "checkpoint-5",
        "checkpoint-6",
    ]


def test_kill_9_during_a_save_keeps_the_previous_checkpoint(
    assets, uninterrupted: Path, tmp_path: Path, monkeypatch
):
    out = tmp_path / "run"
    monkeypatch.setenv("HF_FSDP2_FAULT", "kill_during_save:4:1")
    proc = torchrun(SFT, _args(assets, out, "--save_steps", "2"), check=False)
    monkeypatch.delenv("HF_FSDP2_FAULT")
    assert proc.returncode != 0
    assert (out / "latest").read_text().strip() == "2"
    assert not (out / "checkpoint-4").exists()
    assert (out / ".tmp-checkpoint-4").exists()  # the half-written one stays hidden
    torchrun(SFT, _args(assets, out, "--save_steps", "2", "--resume_from_checkpoint", "latest"))
    assert not (out / ".tmp-checkpoint-4").exists()
    full, resumed = _losses(uninterrupted), _losses(out)
    for step in range(3, 9):
        assert resumed[step] == full[step], step


def _parents() -> dict[int, int]:
    """Every process's parent, from /proc."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return parents


def _descendants(parents: dict[int, int], root: int) -> set[int]:
    """The processes under ``root`` (children, theirs, ...), from :func:`_parents`."""
    found: set[int] = set()
    todo = [root]
    while todo:
        pid = todo.pop()
        kids = [p for p, parent in parents.items() if parent == pid and p not in found]
        found.update(kids)
        todo.extend(kids)
    return found


def _new_ranks(me: int, before: set[int]) -> list[int]:
    """The processes not in ``before`` whose parent is a child of ``me``: a run's ranks (see the test below)."""
    parents = _parents()
    children = {p for p, parent in parents.items() if parent == me}
    return sorted(p for p in _descendants(parents, me) - before if parents.get(p) in children)


def test_sigterm_saves_at_the_next_step_boundary_and_exits_cleanly(assets, tmp_path: Path):
    """SIGTERM to one rank (a preempted node's process), not to the launcher (whose forwarding of it is tested in
    tests/recipes/test_faults.py): the ranks are served (support.launch.torchrun), in a thread while this one signals.
    The ranks are the processes that appear under a child of this process: the launch server's forks, or torchrun's
    children with HF_FSDP2_TEST_LAUNCH_SERVER=0."""
    out = tmp_path / "run"
    me = os.getpid()
    if launch._server_enabled():
        launch._server(launch._env())  # started first: its reload zygote is no rank
    before = _descendants(_parents(), me)
    done: dict[str, object] = {}

    def run() -> None:
        try:
            done["proc"] = torchrun(
                SFT,
                _args(assets, out, "--max_steps", "400", "--save_steps", "1000"),
                check=False,
                timeout=480,
            )
        except BaseException as err:  # noqa: BLE001  # re-raised in the test's thread
            done["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 240
        while time.time() < deadline and thread.is_alive():
            if (out / "metrics.jsonl").is_file() and len(read_metrics(out / "metrics.jsonl")) >= 2:
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"the run logged no steps in time: {done}")
        ranks = _new_ranks(me, before)
        assert len(ranks) == 2, ranks
        os.kill(ranks[-1], signal.SIGTERM)  # preempt one rank
        thread.join(timeout=300)
    finally:
        if (
            thread.is_alive()
        ):  # a failed check: end the run, so that the launch server is free for the next test
            for pid in _new_ranks(me, before):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            thread.join(timeout=60)
    if "error" in done:
        raise done["error"]  # type: ignore[misc]
    proc = done["proc"]
    assert isinstance(proc, subprocess.CompletedProcess)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "SIGTERM: saved checkpoint-" in output
    # Measured and bounded: the SIGTERM ended in a checkpoint well inside the 30 s kill window, as the run said once
    # its steps were measured (a step, a save estimated from the checkpoint's size, the exit).
    took = float(re.search(r"and stopped ([0-9.]+) s after the signal \(kill_window 30 s\)", output)[1])  # type: ignore[index]
    assert 0 < took < 30, output[-3000:]
    assert re.search(
        r"preemption: a SIGTERM is answered at the next step boundary with a checkpoint: a step \([0-9.]+ s\) "
        r"\+ a save \([0-9.]+ s, (measured|estimated at 0.5 GB/s per rank)\) \+ the exit \(2.0 s\) = [0-9.]+ s, "
        r"within the 30.0 s kill window",
        output,
    ), output[-3000:]
    step = int((out / "latest").read_text())
    assert (out / f"checkpoint-{step}" / "trainer_state.json").is_file()
    assert step < 400 and max(_losses(out)) == step


def test_resume_with_an_incompatible_config_is_refused_and_harmless_changes_are_logged(
    assets, uninterrupted: Path, tmp_path: Path
):
    out = tmp_path / "run"
    # The uninterrupted run's checkpoint-3 (max_length 96, logging_steps 1) as this run folder's latest.
    out.mkdir()
    shutil.copytree(uninterrupted / "checkpoint-3", out / "checkpoint-3")
    (out / "latest").write_text("3\n")
    proc = torchrun(
        SFT, _args(assets, out, "--resume_from_checkpoint", "latest", "--max_length", "64"), check=False
    )
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "max_length: checkpoint 96 vs now 64" in text
    proc = torchrun(
        SFT,
        # save_steps 0 (a change that is logged too): no end-of-run checkpoint, which nothing here reads.
        _args(
            assets,
            out,
            "--resume_from_checkpoint",
            "latest",
            "--logging_steps",
            "2",
            "--max_steps",
            "4",
            "--save_steps",
            "0",
        ),
    )
    assert "resuming with a changed setting: logging_steps: 1 -> 2" in proc.stdout + proc.stderr


def test_full_disk_during_save_is_reported_and_keeps_the_previous_checkpoint(assets, tmp_path: Path):
    mount = tmp_path / "small"
    mount.mkdir()
    # ~4.3 MiB a checkpoint (343k fp32 params + 2 Adam moments, measured 4.49 MB): room for one, not two.
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=7M", "tmpfs", str(mount)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        out = mount / "run"
        proc = torchrun(
            SFT,
            _args(assets, out, "--save_steps", "2", "--save_total_limit", "0", "--max_steps", "6"),
            check=False,
        )
        text = proc.stdout + proc.stderr
        assert proc.returncode != 0
        assert "saving checkpoint-4" in text and "failed" in text and "previous checkpoint" in text
        assert (out / "latest").read_text().strip() == "2"
        assert (out / "checkpoint-2" / "trainer_state.json").is_file()
        assert not (out / "checkpoint-4").exists() and not (out / ".tmp-checkpoint-4").exists()
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_resume_without_any_checkpoint_is_a_clear_error(assets, tmp_path: Path):
    proc = torchrun(SFT, _args(assets, tmp_path / "empty", "--resume_from_checkpoint", "latest"), check=False)
    assert proc.returncode != 0
    assert "holds no complete checkpoint" in proc.stdout + proc.stderr
