"""A user's install: the wheel built from this checkout, installed into a fresh virtual environment, runs
`hf-fsdp2 train` on the packaged CPU demo config from outside the checkout (the methods, recipe configs and
accelerate configs inside the package; no recipes/ script); a TRL-style YAML of the common keys trains."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from support.launch import REPO
from support.tiny import make_tiny_llama_dir, write_chat_jsonl

from hf_fsdp2.observe.logs import read_metrics


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel of this checkout (its dependencies from the test environment: a .pth file
    puts the test environment's site-packages after the venv's own, so nothing of the checkout leaks in)."""
    root = tmp_path_factory.mktemp("install")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(root / "dist"),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    wheel = next((root / "dist").glob("hf_fsdp2-*.whl"))
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # The test environment's site-packages: .venv's own and, where scripts/setup.sh made .venv over a shared base venv,
    # the base's (added by a .pth file there, which a plain path line here does not run).
    own = sysconfig.get_paths()["purelib"]
    deps = [own, *(p for p in sys.path if p.rstrip("/").endswith("site-packages") and p != own)]
    Path(site, "deps.pth").write_text("".join(f"{p}\n" for p in deps))
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)],
        check=True,
        capture_output=True,
        text=True,
    )
    return venv


def _run(venv: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    return subprocess.run(
        [str(venv / "bin" / "hf-fsdp2"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def test_the_installed_wheel_trains_the_packaged_cpu_demo_config_outside_the_checkout(
    installed, tmp_path
) -> None:
    py = installed / "bin" / "python"
    where = subprocess.run(
        [
            str(py),
            "-c",
            "import importlib.resources as r, hf_fsdp2.methods.sft as m; "
            "print(m.__file__); print(r.files('hf_fsdp2.recipe_configs'))",
        ],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert all(w.startswith(str(installed)) for w in where), where  # the wheel's copies, not the checkout
    configs = Path(where[1])
    assert (configs / "demo_smollm2.yaml").is_file() and (configs / "dpo_cpu_demo.yaml").is_file()
    model = make_tiny_llama_dir(tmp_path / "model")
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 16)
    proc = _run(
        installed,
        [
            "train",
            "--config",
            str(configs / "demo_smollm2.yaml"),
            "--model_name_or_path",
            str(model),
            "--dataset_name",
            str(data),
            "--output_dir",
            str(tmp_path / "run"),
            "--max_steps",
            "2",
            "--warmup_steps",
            "0",
            "--logging_steps",
            "1",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "accelerate.commands.launch" in proc.stderr and "fsdp2_cpu.yaml --num_processes 2" in proc.stderr
    assert "world size 2 on cpu" in proc.stderr and "export verified" in proc.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2]


def test_a_trl_style_yaml_trains(installed, tmp_path: Path) -> None:
    model = make_tiny_llama_dir(tmp_path / "model")
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 16)
    recipe = tmp_path / "trl.yaml"
    # TRL's SFT script keys: bf16, dtype, dataset_train_split, dataset_config (none here), a report_to list,
    # eval_strategy, optim, save_strategy, max_seq_length (older TRL).
    recipe.write_text(
        f"""model_name_or_path: {model}
dataset_name: {data}
dataset_train_split: train
dtype: float32
bf16: false
max_seq_length: 64
output_dir: {tmp_path / "run"}
per_device_train_batch_size: 2
max_steps: 2
learning_rate: 2.0e-5
optim: adamw_torch_fused
report_to: [tensorboard]
eval_strategy: "no"
save_strategy: steps
logging_steps: 1
"""
    )
    proc = _run(
        installed, ["train", "sft", "--config", str(recipe), "--export_verify", "false"], cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    saved = (tmp_path / "run" / "hf_fsdp2_config.yaml").read_text()
    assert (
        "mixed_precision: 'no'" in saved and "max_length: 64" in saved and "report_to: tensorboard" in saved
    )
    assert any((tmp_path / "run" / "tensorboard").rglob("events.out.tfevents.*"))
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and json.dumps(rows)
