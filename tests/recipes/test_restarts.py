"""Runs that finish by themselves (docs/restarts.md), end to end on 2 gloo ranks under torch's own elastic agent:
the real ``accelerate launch --max_restarts`` / ``torchrun --max_restarts`` (tests/support/launch.py: ``elastic``, the
agent forking each attempt's ranks from the launch server) with faults injected by the test's rank wrapper
(tests/support/elastic_rank.py; the library holds no hook of its own but the checkpointer's kill during a save).

* one SFT run with ``max_restarts: 3`` whose rank 1 is killed (SIGKILL) three times, at the start of a step, while
  a checkpoint is written and during the export, finishes by itself; its losses, its final weights and its export
  equal an uninterrupted run's exactly, restarts.json / summary.json / the model card name each restart's rank,
  where it ended and the steps lost, and the checkpoint being written when it died is never resumed;
  ``resume_from_checkpoint: auto`` then refuses the uninterrupted run's folder for another seed (another run's);
* a run whose rank fails at the same step in every attempt stops after its restarts, saying so with the cause.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from support.launch import REPO, SFT, accelerate_launch, elastic
from support.runs import shared_assets

from hf_fsdp2.observe.logs import read_metrics

CPU_CONFIG = str(REPO / "accelerate_configs" / "fsdp2_cpu.yaml")


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return shared_assets(tmp_path_factory)


def _recipe(path: Path, model: Path, data: Path, out: Path, **overrides: object) -> Path:
    values = {
        "model_name_or_path": str(model),
        "dataset_name": str(data),
        "output_dir": str(out),
        "max_steps": 6,
        "save_steps": 2,
        "per_device_train_batch_size": 2,
        "max_length": 64,
        "logging_steps": 1,
        "learning_rate": 1e-3,
        "mixed_precision": "no",
        "export_verify": False,
        **overrides,
    }
    path.write_text(yaml.safe_dump(values))
    return path


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if "event" not in r}


def test_three_kills_finish_by_themselves_and_equal_an_uninterrupted_run(assets, tmp_path: Path) -> None:
    model, data = assets
    reference = tmp_path / "reference"
    accelerate_launch(
        "accelerate_configs/fsdp2_cpu.yaml",
        SFT,
        ["--config", str(_recipe(tmp_path / "ref.yaml", model, data, reference))],
        served=True,
    )
    out = tmp_path / "run"
    recipe = _recipe(tmp_path / "r.yaml", model, data, out, max_restarts=3)
    faults = [
        {"attempt": 0, "rank": 1, "at": "step", "step": 3},  # checkpoint-2 is the newest: resumed there
        {"attempt": 1, "rank": 1, "at": "save", "step": 4},  # checkpoint-4's shards written, never published
        {"attempt": 2, "rank": 1, "at": "export"},  # checkpoint-6 saved: the export alone is done again
    ]
    proc = elastic(
        SFT,
        ["--config", str(recipe)],
        launcher_args=["--config_file", CPU_CONFIG, "--max_restarts", "3"],
        faults=faults,
    )
    assert proc.stderr.count("test fault:") == 2, proc.stderr[
        -4000:
    ]  # the kill in the save is the library's own

    # The same steps, the same losses, the same weights: bit for bit.
    assert _losses(out) == _losses(reference)
    got, want = load_file(str(out / "model.safetensors")), load_file(str(reference / "model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (reference / "config.json").read_text()
    )
    assert not list(out.glob(".tmp-checkpoint-*")) and not (out / ".hf_fsdp2_attempt").exists()

    restarts = json.loads((out / "restarts.json").read_text())["restarts"]
    assert [r["restart"] for r in restarts] == [1, 2, 3]
    assert [(r["step"], r["phase"]) for r in restarts] == [(3, "step"), (4, "checkpoint save"), (6, "export")]
    assert all(
        r["ranks"] == [1] and r["kind"] == "lost" and "rank 1 ended without an error" in r["cause"]
        for r in restarts
    )
    # The save killed mid-way left checkpoint-2 the newest complete one: resumed from it, steps 3 and 4 lost.
    assert [(r["resumed_from_step"], r["steps_lost"]) for r in restarts] == [(2, 0), (2, 2), (6, 0)]
    assert "restart 2 of 3: the previous attempt ended in the checkpoint save after step 4" in proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["restarts"]) == 3 and summary["steps_lost_to_restarts"] == 2
    card = (out / "README.md").read_text()
    assert "## Restarts" in card and "| 2 | 4 | rank 1 ended without an error" in card

    # auto continues this run's checkpoints, never another run's: the reference's folder with another seed.
    other = _recipe(tmp_path / "o.yaml", model, data, reference, seed=7, resume_from_checkpoint="auto")
    proc = accelerate_launch(
        "accelerate_configs/fsdp2_cpu.yaml", SFT, ["--config", str(other)], served=True, check=False
    )
    assert proc.returncode != 0
    assert (
        f"resume_from_checkpoint=auto: {reference / 'checkpoint-6'} is another run's checkpoint"
        in proc.stderr
    )
    assert "seed: checkpoint 42 vs now 7" in proc.stderr


def test_a_failure_at_the_same_step_stops_after_its_restarts_with_the_cause(assets, tmp_path: Path) -> None:
    model, data = assets
    out = tmp_path / "run"
    recipe = _recipe(tmp_path / "r.yaml", model, data, out, max_steps=3, save_steps=1)
    faults = [{"attempt": a, "rank": 1, "at": "error", "step": 2} for a in (0, 1)]
    proc = elastic(
        SFT,
        ["--config", str(recipe)],
        launcher="torchrun",
        launcher_args=["--nproc_per_node", "2", "--max_restarts", "1", "--monitor_interval", "0.1"],
        faults=faults,
        check=False,
    )
    assert proc.returncode != 0
    assert "RuntimeError: injected failure at step 2" in proc.stderr
    said = [line for line in proc.stderr.splitlines() if "No restart is left" in line]
    assert (
        said
        and "all 2 attempts (max_restarts 1) ended during step 2, so the failure is not transient" in said[0]
    )
    (restart,) = json.loads((out / "restarts.json").read_text())["restarts"]
    assert restart["kind"] == "error" and restart["ranks"] == [1] and restart["step"] == 2
    assert restart["cause"] == "rank 1: RuntimeError: injected failure at step 2"
    assert restart["resumed_from_step"] == 1 and restart["steps_lost"] == 0
    # The agent ran both attempts and no third (max_restarts 1).
    assert proc.stderr.count("test fault: error at step 2") == 2
