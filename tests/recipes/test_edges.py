"""Reliability at the edges, end to end on 2 gloo ranks: no run lost, no output folder corrupted, one clear
error per failure.

* two runs started into one output_dir: one owns it, the other is refused naming the owner;
* a damaged checkpoint: named, and ``latest`` falls back to the newest one that is whole;
* a failed export: the final state is saved as a checkpoint first, which exports offline to the bytes
  the run would have written;
* a failed start (a missing dataset): one error line, and the same command works once the data exists;
* unreadable JSON lines: named with file and line, or skipped and counted;
* a tokenizer larger than the embedding: refused before any work, or resized.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from support import launch
from support.launch import REPO, SFT, _env, free_port, python
from support.runs import copy_run, finished_run, sft_2ranks, shared_assets, write_recipe
from support.tiny import write_chat_jsonl

from hf_fsdp2.checkpoint.resume import checkpoint_problems
from hf_fsdp2.observe.logs import read_metrics


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return shared_assets(tmp_path_factory)


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 4-step run with checkpoint-2 and checkpoint-4 (shared with test_faults.py on this worker)."""
    return finished_run(tmp_path_factory)


_recipe, _sft = write_recipe, sft_2ranks


def _one_error(proc: subprocess.CompletedProcess[str]) -> str:
    """The run failed with exactly one ``hf_fsdp2 error`` line and no traceback from any rank (torchrun's
    own report of a failed child, which names no rank, is torchrun's)."""
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("hf_fsdp2 error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert not [line for line in proc.stderr.splitlines() if line.startswith("[rank")], proc.stderr[-3000:]
    assert "gloo" not in proc.stderr.lower(), proc.stderr[-3000:]
    return lines[0]


def _lock_taken(lock: Path) -> bool:
    """The run's lock file exists and names its owner (it is created, then written)."""
    try:
        return bool(json.loads(lock.read_text() or "{}"))
    except (OSError, ValueError):
        return False


def test_two_runs_into_one_output_dir_one_owns_it(assets, tmp_path: Path) -> None:
    model, data = assets
    out = tmp_path / "run"
    recipes = [
        _recipe(tmp_path / f"r{seed}.yaml", model, data, out, seed=seed, save_steps=2) for seed in (11, 12)
    ]
    # The first run is torchrun itself in the background (the launch server serves one run at a time); the second,
    # served, starts once the first holds the lock, so that it meets a live owner whichever way the race would go.
    if launch._server_enabled():
        launch._server(
            launch._env()
        )  # started now: the second run starts at once, before the first writes more
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(SFT),
        "--config",
        str(recipes[0]),
    ]
    logs = [tmp_path / "first.out", tmp_path / "first.err"]  # files: no pipe fills while the second run runs
    with open(logs[0], "w") as stdout, open(logs[1], "w") as stderr:
        first = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=stdout, stderr=stderr)
    try:
        deadline = time.time() + 300
        while not _lock_taken(out / ".hf_fsdp2.lock") and first.poll() is None and time.time() < deadline:
            if not launch._server_enabled():  # two fresh launches: the second's own start-up is the stagger
                break
            time.sleep(0.02)
        second = _sft(recipes[1], check=False)
        results = [
            (first.wait(timeout=600), (logs[0].read_text(), logs[1].read_text())),
            (second.returncode, (second.stdout, second.stderr)),
        ]
    finally:
        if first.poll() is None:
            first.kill()
    codes = sorted(code for code, _ in results)
    assert codes[0] == 0 and codes[1] != 0, [r[1][1][-2000:] for r in results]
    winner = 11 if results[0][0] == 0 else 12
    loser_err = next(err for code, (_, err) in results if code != 0)
    assert "is in use by another run (pid" in loser_err
    assert yaml.safe_load((out / "hf_fsdp2_config.yaml").read_text())["seed"] == winner  # its own config
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]  # one run's steps, once
    for step in (2, 4):
        assert checkpoint_problems(out / f"checkpoint-{step}") == []
    assert not (out / ".hf_fsdp2.lock").exists()  # released at the end


def test_a_damaged_checkpoint_is_named_and_latest_falls_back(assets, finished: Path, tmp_path: Path) -> None:
    model, data = assets
    out = copy_run(finished, tmp_path / "run")  # a finished run of this recipe: checkpoint-2 and checkpoint-4
    recipe = _recipe(tmp_path / "r.yaml", model, data, out, save_steps=2)
    shard = sorted((out / "checkpoint-4").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated
    proc = _sft(recipe, "--resume_from_checkpoint", str(out / "checkpoint-4"), check=False)
    error = _one_error(proc)
    assert "checkpoint-4 is damaged" in error and shard.name in error and "truncated" in error
    proc = _sft(recipe, "--resume_from_checkpoint", "latest", "--max_steps", "6")
    log = proc.stdout + proc.stderr
    assert "skipping" in log and "checkpoint-4, which is damaged" in log and shard.name in log
    assert "resumed from" in log and "checkpoint-2 at step 2" in log


def test_a_failed_export_keeps_the_weights_and_they_export_offline_to_the_same_bytes(
    assets, finished: Path, tmp_path: Path
) -> None:
    model, data = assets
    good = finished  # the same recipe (its checkpoint at step 2 changes no weight): the export the run should write
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / ".export-incomplete").write_text(
        "a file where the export stages its folder"
    )  # the export fails
    proc = _sft(_recipe(tmp_path / "broken.yaml", model, data, broken), check=False)
    error = _one_error(proc)
    assert "The trained weights are safe in" in proc.stderr and "hf-fsdp2 export" in proc.stderr, error
    ckpt = broken / "checkpoint-4"
    assert checkpoint_problems(ckpt) == []
    assert not (broken / "model.safetensors").exists()
    offline = tmp_path / "offline"
    python(REPO / "hf_fsdp2" / "cli.py", ["export", str(ckpt), str(offline)])
    assert (offline / "model.safetensors").read_bytes() == (good / "model.safetensors").read_bytes()
    # The card gets the run's figures of the checkpoint's step, read by the command and handed to the export.
    last = read_metrics(broken / "metrics.jsonl")[-1]
    card = (offline / "README.md").read_text()
    assert "No metrics were recorded." not in card and f"| loss | {last['loss']:.6g} |" in card


def test_a_failed_start_says_it_once_and_the_same_command_then_works(assets, tmp_path: Path) -> None:
    model, _ = assets
    out = tmp_path / "run"
    missing = tmp_path / "later.jsonl"
    recipe = _recipe(tmp_path / "r.yaml", model, missing, out)
    error = _one_error(_sft(recipe, check=False))
    assert "later.jsonl" in error and "does not exist" in error
    assert "resume_from_checkpoint" not in error
    write_chat_jsonl(missing, 32, seed=1)
    _sft(recipe)  # the folder of the failed start is reused
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]
    # Now it holds a finished run and its end-of-run checkpoint: refused, and resuming it is offered.
    assert (out / "checkpoint-4").is_dir()
    again = _one_error(_sft(recipe, check=False))
    assert "already holds a previous run" in again and "--resume_from_checkpoint latest" in again


def test_unreadable_json_lines_are_named_or_skipped_and_counted(assets, tmp_path: Path) -> None:
    model, data = assets
    lines = data.read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(
        ("\n".join(lines[:5]) + '\n{"messages": [oops\n').encode()
        + b'{"x": "\xff"}\n'
        + ("\n".join(lines[5:]) + "\n").encode()
    )
    error = _one_error(_sft(_recipe(tmp_path / "e.yaml", model, bad, tmp_path / "e"), check=False))
    assert f"{bad}:6: not valid JSON" in error and "2 such line(s)" in error and "on_bad_record=skip" in error
    # save_steps 0: no end-of-run checkpoint, which nothing here reads.
    proc = _sft(_recipe(tmp_path / "s.yaml", model, bad, tmp_path / "s", on_bad_record="skip", save_steps=0))
    log = proc.stdout + proc.stderr
    assert "2 bad records skipped (2 unreadable line)" in log
    assert f"{bad}:7: not UTF-8 text (byte 0xff" in log


def test_a_tokenizer_larger_than_the_embedding_is_refused_before_any_work_or_resized(
    assets, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    model, data = assets
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.add_tokens(["<extra_a>", "<extra_b>"])
    tokenizer.save_pretrained(tmp_path / "tok")
    out = tmp_path / "refused"
    recipe = _recipe(tmp_path / "r.yaml", model, data, out, tokenizer_name_or_path=str(tmp_path / "tok"))
    error = _one_error(_sft(recipe, check=False))
    rows = len(tokenizer) - 2
    assert f"the tokenizer has {rows + 2} tokens but the model's embedding has {rows} rows" in error
    assert not (out / "metrics.jsonl").exists()
    resized = tmp_path / "resized"
    _sft(
        _recipe(
            tmp_path / "ok.yaml",
            model,
            data,
            resized,
            tokenizer_name_or_path=str(tmp_path / "tok"),
            resize_token_embeddings=True,
            save_steps=0,
        )
    )  # no checkpoint: nothing reads one
    assert json.loads((resized / "config.json").read_text())["vocab_size"] == rows + 2


def test_a_lora_run_whose_export_fails_exports_offline_to_the_same_adapter_and_merge(
    assets, tmp_path: Path
) -> None:
    model, data = assets
    lora = {"use_peft": True, "lora_r": 4, "lora_alpha": 8, "merge_adapter": True, "learning_rate": 1e-2}
    good = tmp_path / "good"
    _sft(_recipe(tmp_path / "good.yaml", model, data, good, **lora))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / ".adapter-incomplete").write_text(
        "a file where the adapter is staged"
    )  # the adapter save fails
    proc = _sft(_recipe(tmp_path / "broken.yaml", model, data, broken, **lora), check=False)
    assert "writing the adapter" in _one_error(proc)
    assert (
        f"The trained weights are safe in {broken / 'checkpoint-4'}" in proc.stderr
        and "hf-fsdp2 export" in proc.stderr
    )
    offline = tmp_path / "offline"
    python(REPO / "hf_fsdp2" / "cli.py", ["export", str(broken / "checkpoint-4"), str(offline)])
    for name in ("adapter_model.safetensors", "merged/model.safetensors"):
        assert (offline / name).read_bytes() == (good / name).read_bytes(), name
