"""scripts/gpu_check.sh on a CPU machine: the dry run lists every GPU check and validates its commands (recipe
configs, accelerate launch lines, bench flags) and writes the JSON summary; a real run refuses without CUDA."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from support.launch import REPO

CHECKS = [
    "sft_smollm2",
    "sft_tiny[tied]",
    "sft_tiny[untied]",
    "lora_merge",
    "activation_offload",
    "memory_snapshot",
    "gpu_bench_quick",
]


def gpu_check(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), "--no-setup", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_dry_run_lists_every_check_and_validates_its_commands(tmp_path: Path):
    out = tmp_path / "gpu" / "summary.json"
    proc = gpu_check("--dry-run", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.rstrip().endswith(f"GPU check summary: {out}")
    report = json.loads(out.read_text())
    assert report["dry_run"] is True and report["torch"] == torch.__version__
    assert [c["name"] for c in report["checks"]] == CHECKS
    assert (report["passed"], report["failed"], report["skipped"]) == (len(CHECKS), 0, 0)
    for check in report["checks"]:
        assert check["ok"] is True and check["error_tail"] is None and check["seconds"] >= 0, check
    commands = {c["name"]: c["figures"]["command"] for c in report["checks"]}
    # Every recipe check: the SFT recipe through accelerate launch with the packaged FSDP2 config, one process.
    for name in CHECKS[:-1]:
        assert commands[name].startswith("accelerate launch --config_file "), commands[name]
        assert (
            "fsdp2.yaml --num_processes 1 " in commands[name]
            and "-m hf_fsdp2.recipes.sft --config" in commands[name]
        )
    assert commands["gpu_bench_quick"].startswith("python bench/gpu_bench.py --quick")
    # The recipes it would run hold the GPU path: bf16, regional compile, activation checkpointing, chunked CE.
    recipe = (out.parent / "summary.work").glob("test_sft_tiny_tied_0/sft/recipe.yaml")
    text = next(recipe).read_text()
    for line in ("mixed_precision: bf16", "torch_compile: true", "torch_compile_scope: regional",
                 "activation_checkpointing: full", "ce_chunk_tokens: 64"):  # fmt: skip
        assert line in text, (line, text)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks that a machine without CUDA is refused")
def test_without_cuda_a_real_run_is_refused(tmp_path: Path):
    out = tmp_path / "summary.json"
    proc = gpu_check("--out", str(out))
    assert proc.returncode == 1
    assert "sees no CUDA device" in proc.stderr and "--dry-run" in proc.stderr
    assert not out.exists()


def test_bad_arguments_are_refused():
    proc = gpu_check("--frobnicate")
    assert proc.returncode == 2 and "unknown argument --frobnicate" in proc.stderr
