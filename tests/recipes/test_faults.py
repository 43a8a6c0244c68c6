"""Fault injection, end to end on 2 gloo ranks: a run is never lost or poisoned (issue 25).

* overwrite_output_dir with save_total_limit over an older run's folder: the older run's checkpoints are removed
  first, retention keeps the new run's own checkpoint, and ``latest`` resumes the new run;
* a full disk (a small tmpfs): refused at the start when one checkpoint cannot fit; a save that runs out of
  space is named as such, with the path, the bytes needed and what truthfully exists;
* a read-only output_dir: one error line, exit status 2 on every rank.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from support.launch import SFT, torchrun
from support.tiny import make_tiny_llama_dir, write_chat_jsonl


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("faults")
    return make_tiny_llama_dir(root / "model", seed=4), write_chat_jsonl(root / "chat.jsonl", 32, seed=9)


def _recipe(path: Path, model: Path, data: Path | str, out: Path, **overrides: object) -> Path:
    values = {
        "model_name_or_path": str(model), "dataset_name": str(data), "output_dir": str(out), "max_steps": 4,
        "per_device_train_batch_size": 2, "max_length": 64, "logging_steps": 1, "learning_rate": 1e-3,
        "mixed_precision": "no", **overrides,
    }  # fmt: skip
    path.write_text(yaml.safe_dump(values))
    return path


def _sft(recipe: Path, *extra: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return torchrun(SFT, ["--config", str(recipe), *extra], nproc=2, timeout=600, check=check)


def _one_error(proc: subprocess.CompletedProcess[str]) -> str:
    """Exactly one ``hf_fsdp2 error`` line, no traceback from any rank."""
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("hf_fsdp2 error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr.replace("torch.distributed.elastic", ""), proc.stderr[-3000:]
    return lines[0]


def _run_id(checkpoint: Path) -> str:
    return str(json.loads((checkpoint / "trainer_state.json").read_text())["run_id"])


def test_overwrite_with_retention_never_keeps_or_resumes_the_older_run(assets, tmp_path: Path) -> None:
    model, data = assets
    out = tmp_path / "run"
    _sft(_recipe(tmp_path / "old.yaml", model, data, out, max_steps=6, save_steps=2))
    old_id = _run_id(out / "checkpoint-6")
    new = _recipe(tmp_path / "new.yaml", model, data, out, max_steps=3, save_steps=3, save_total_limit=1, seed=7,
                  overwrite_output_dir=True)  # fmt: skip
    proc = _sft(new)
    log = proc.stdout + proc.stderr
    assert "removed the previous run's checkpoints" in log and "checkpoint-6" in log
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3"]
    assert (out / "latest").read_text().strip() == "3"
    assert _run_id(out / "checkpoint-3") not in ("", old_id)
    proc = _sft(
        new, "--resume_from_checkpoint", "latest", "--max_steps", "4", "--overwrite_output_dir", "false"
    )
    log = proc.stdout + proc.stderr
    assert "resumed from" in log and "checkpoint-3 at step 3" in log
    # The checkpoint resumed from is kept; the resumed run keeps its identity.
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    assert _run_id(out / "checkpoint-4") == _run_id(out / "checkpoint-3")
