"""A 2-rank SFT run of a tiny model from a recipe file: the helpers the end-to-end fault and edge tests share."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from support.launch import SFT, torchrun


def write_recipe(path: Path, model: Path, data: Path | str, out: Path, **overrides: object) -> Path:
    """A 4-step fp32 recipe of ``model`` on ``data`` into ``out``, with ``overrides``; returns its path.

    The export is written but not verified unless ``export_verify=True`` is passed: verification reloads the export in
    a fresh process (~10 s a run) and is tested where it is the subject (tests/unit/test_export*.py)."""
    values = {
        "model_name_or_path": str(model), "dataset_name": str(data), "output_dir": str(out), "max_steps": 4,
        "per_device_train_batch_size": 2, "max_length": 64, "logging_steps": 1, "learning_rate": 1e-3,
        "mixed_precision": "no", "export_verify": False, **overrides,
    }  # fmt: skip
    path.write_text(yaml.safe_dump(values))
    return path


def sft_2ranks(
    recipe: Path, *extra: str, check: bool = True, real_launcher: bool = False
) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc_per_node 2 recipes/sft.py --config recipe`` (``real_launcher``: see support.launch.torchrun)."""
    return torchrun(
        SFT, ["--config", str(recipe), *extra], nproc=2, timeout=600, check=check, real_launcher=real_launcher
    )
