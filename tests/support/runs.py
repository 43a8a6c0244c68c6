"""A 2-rank SFT run of a tiny model from a recipe file: the helpers the end-to-end fault and edge tests share."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from support.launch import SFT, torchrun


def write_recipe(path: Path, model: Path, data: Path | str, out: Path, **overrides: object) -> Path:
    """A 4-step fp32 recipe of ``model`` on ``data`` into ``out``, with ``overrides``; returns its path.

    The export is written but not verified unless ``export_verify=True`` is passed: verification reloads the export in
    a fresh process (~10 s a run) and is tested where it is the subject (tests/unit/test_export*.py)."""
    values = {
        "model_name_or_path": str(model),
        "dataset_name": str(data),
        "output_dir": str(out),
        "max_steps": 4,
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


def sft_2ranks(
    recipe: Path, *extra: str, check: bool = True, real_launcher: bool = False
) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc_per_node 2 recipes/sft.py --config recipe`` (``real_launcher``: see support.launch.torchrun)."""
    return torchrun(
        SFT, ["--config", str(recipe), *extra], nproc=2, timeout=600, check=check, real_launcher=real_launcher
    )


# One tiny model, one chat file and one finished run per pytest worker, shared by the files that start from them
# (tests/recipes/test_edges.py, test_faults.py): a test that changes the run works on its own copy (copy_run).
_shared: dict[str, tuple[Path, ...]] = {}


def shared_assets(factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny Llama (seed 4) and 32 chat records (seed 9), made once per pytest worker."""
    if "assets" not in _shared:
        from support.tiny import make_tiny_llama_dir, write_chat_jsonl

        root = factory.mktemp("shared_assets")
        _shared["assets"] = (
            make_tiny_llama_dir(root / "model", seed=4),
            write_chat_jsonl(root / "chat.jsonl", 32, seed=9),
        )
    model, data = _shared["assets"]
    return model, data


def finished_run(factory: pytest.TempPathFactory) -> Path:
    """A finished 2-rank run of :func:`write_recipe`'s defaults with ``save_steps=2`` on :func:`shared_assets`
    (checkpoint-2, checkpoint-4, the export), made once per pytest worker. Read it; change a :func:`copy_run`."""
    if "run" not in _shared:
        model, data = shared_assets(factory)
        root = factory.mktemp("finished_run")
        sft_2ranks(write_recipe(root / "r.yaml", model, data, root / "run", save_steps=2))
        _shared["run"] = (root / "run",)
    return _shared["run"][0]


def copy_run(run: Path, to: Path) -> Path:
    """A copy of the run folder ``run`` at ``to`` (a recipe pointed at ``to`` resumes it as its own)."""
    shutil.copytree(run, to, symlinks=True)
    return to
