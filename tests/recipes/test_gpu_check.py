"""scripts/gpu_check.sh on a CPU machine: the dry run lists every GPU check and validates its commands (recipe
configs, accelerate launch lines, bench flags) and writes the JSON summary; a real run refuses without CUDA;
``--offline`` runs with the given Python from the checkout, installs a bundle with pip told there is no index."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch
from support.launch import REPO

CHECKS = [
    "sft_tiny[tied]",
    "sft_tiny[untied]",
    "lora_merge",
    "qlora_merge",
    "activation_offload",
    "memory_snapshot",
    "gpu_bench_quick",
    "memory_plan_1b",
    "grpo_tiny",
    "liger",
    "ring_cp",
    "vllm_weight_sync",
    "parallel_counts",
    "tp_counts",
    "ep_counts",
    "vllm_colocate_rollout",
    "vllm_server_rollout",
]
RECIPE_CHECKS = ["sft_tiny[tied]", "sft_tiny[untied]", "lora_merge", "memory_snapshot"]


def gpu_check(
    *args: str, env: dict[str, str] | None = None, setup: bool = False
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), *([] if setup else ["--no-setup"]), *args],
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
    # Files run longest first by tests/conftest.py's measured durations: the order across files is not fixed.
    assert sorted(c["name"] for c in report["checks"]) == sorted(CHECKS)
    assert (report["passed"], report["failed"], report["skipped"]) == (len(CHECKS), 0, 0)
    for check in report["checks"]:
        assert check["ok"] is True and check["error_tail"] is None and check["seconds"] >= 0, check
    commands = {c["name"]: c["figures"]["command"] for c in report["checks"]}
    # Every recipe check: the SFT recipe through accelerate launch with the packaged FSDP2 config, one process.
    for name in RECIPE_CHECKS:
        assert commands[name].startswith("accelerate launch --config_file "), commands[name]
        assert (
            "fsdp2.yaml --num_processes 1 " in commands[name]
            and "-m hf_fsdp2.methods sft --config" in commands[name]
        )
    assert commands["gpu_bench_quick"].startswith("python bench/gpu_bench.py --quick")
    # the FP8 check: the quick bench's regional runner beside its mixed_precision fp8 twin (bf16 vs FP8 tokens/s)
    quick = next(c["figures"] for c in report["checks"] if c["name"] == "gpu_bench_quick")
    assert quick["configs"].split(",") == [
        "eager:none:chunked",
        "regional:none:chunked",
        "regional:none:chunked:fp8",
    ]
    assert commands["memory_plan_1b"].startswith("python bench/memory_plan_gpu.py --modes none,full")
    assert commands["liger"].startswith("HF_FSDP2_GPU_CHECK=1 python -m pytest")
    assert "fsdp2.yaml --num_processes 1 " in commands["grpo_tiny"]
    assert "-m hf_fsdp2.methods grpo --config" in commands["grpo_tiny"]
    assert all(c["budget_s"] > 0 for c in report["checks"])
    one_gpu = [c["budget_s"] for c in report["checks"] if c["min_gpus"] == 1 and not c["needs_vllm"]]
    assert report["budget_s"] == sum(one_gpu) <= report["total_budget_s"] == 540
    # The ring, weight-sync, parallel-counts and vLLM server checks need 2 GPUs, the tensor-parallel counts 4 (skipped
    # on one H200): their budgets apart, the ring's three launch lines validated, the counts checks' bench flags
    # (cp 2 + Muon, tp 2 x dp 2: counts beside seconds). The vLLM checks need .venv-vllm, which the lent image lacks.
    assert report["multi_gpu_budget_s"] == 150 + 60 + 120 + 120 + 180 and commands["ring_cp"].startswith(
        "accelerate launch "
    )
    assert report["needs_vllm_budget_s"] == 150
    assert commands["parallel_counts"].startswith("python bench/gpu_bench_parallel.py --shape 1b --cp 2")
    assert "--optim muon" in commands["parallel_counts"]
    assert commands["tp_counts"].startswith("python bench/gpu_bench_parallel.py --shape 1b --tp 2 --procs 4")
    assert commands["ep_counts"].startswith("python bench/moe_bench.py ep --procs=2 --eps=1,2")
    assert commands["vllm_colocate_rollout"].startswith("python bench/grpo_bench.py --backends colocate")
    assert commands["vllm_server_rollout"].startswith("python bench/grpo_bench.py --backends vllm")
    expected = {c["name"]: c["figures"].get("expected_collectives_per_step") for c in report["checks"]}
    assert expected["tp_counts"] == {"all_gather": 134, "reduce_scatter": 98, "all_reduce": 37}
    ring = next(c["figures"] for c in report["checks"] if c["name"] == "ring_cp")
    assert (
        "--num_processes 1 " in ring["cp1:command"]
        and "-m hf_fsdp2.methods cpt --config" in ring["cp1:command"]
    )
    assert "--num_processes 2 " in ring["ring:command"] and "--num_processes 2 " in ring["all_to_all:command"]
    assert "time / budget" in proc.stdout
    # The recipes it would run hold the GPU path: bf16, regional compile, activation checkpointing, chunked CE.
    recipe = (out.parent / "summary.work").glob("test_sft_tiny_tied_0/sft/recipe.yaml")
    text = next(recipe).read_text()
    for line in (
        "mixed_precision: bf16",
        "torch_compile: true",
        "torch_compile_scope: regional",
        "activation_checkpointing: full",
        "ce_chunk_tokens: 64",
    ):
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


def probe_wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel (``gpucheck_probe 0.1``), written by hand: a bundle that needs no index."""
    files = {
        "gpucheck_probe/__init__.py": b"VALUE = 42\n",
        "gpucheck_probe-0.1.dist-info/METADATA": b"Metadata-Version: 2.1\nName: gpucheck-probe\nVersion: 0.1\n",
        "gpucheck_probe-0.1.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [
        f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}"
        for name, data in files.items()
    ]
    files["gpucheck_probe-0.1.dist-info/RECORD"] = (
        "\n".join([*record, "gpucheck_probe-0.1.dist-info/RECORD,,"]) + "\n"
    ).encode()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "gpucheck_probe-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path


def test_offline_uses_the_given_python_from_the_checkout_and_installs_the_bundle_without_an_index(
    tmp_path: Path,
):
    bundle = tmp_path / "bundle"
    probe_wheel(bundle / "wheels")
    (bundle / "requirements.txt").write_text("gpucheck-probe==0.1\n")
    out = tmp_path / "offline" / "summary.json"
    python = str(REPO / ".venv" / "bin" / "python")
    # No .venv on PATH, pip told there is no index (and an index URL that refuses connections).
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHON": python,
        "PIP_NO_INDEX": "1",
        "PIP_INDEX_URL": "http://127.0.0.1:9/",
    }
    proc = gpu_check(
        "--offline",
        "--bundle",
        str(bundle),
        "--dry-run",
        "--out",
        str(out),
        "-k",
        "liger",
        env=env,
        setup=True,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "setup.sh" not in proc.stdout + proc.stderr
    pip_lines = [line for line in proc.stdout.splitlines() if " -m pip " in line]
    assert len(pip_lines) == 1 and "--no-index --no-deps --target" in pip_lines[0], pip_lines
    site = out.parent / "summary.site"
    assert (site / "bundle" / "gpucheck_probe" / "__init__.py").is_file()
    report = json.loads(out.read_text())
    assert report["python"] == python
    # hf_fsdp2 came from the checkout, laid out as installed (the recipe configs inside), not from an install
    assert report["packages"]["hf_fsdp2"].endswith(f"({site / 'checkout' / 'hf_fsdp2'})"), report["packages"]
    assert (site / "checkout" / "hf_fsdp2" / "recipe_configs").resolve() == REPO / "recipes" / "configs"
    assert (
        site / "checkout" / "hf_fsdp2" / "methods" / "sft"
    ).resolve() == REPO / "hf_fsdp2" / "methods" / "sft"
    assert [c["name"] for c in report["checks"]] == ["liger"] and report["passed"] == 1


def test_offline_refuses_a_bundle_without_requirements(tmp_path: Path):
    (tmp_path / "empty").mkdir()
    proc = gpu_check(
        "--bundle",
        str(tmp_path / "empty"),
        "--dry-run",
        "--out",
        str(tmp_path / "s.json"),
        env={"PYTHON": str(REPO / ".venv" / "bin" / "python")},
    )
    assert proc.returncode == 1 and "requirements.txt is missing" in proc.stderr


def test_the_liger_test_fails_not_skips_under_the_gpu_check_without_liger_or_cuda():
    env = {**os.environ, "HF_FSDP2_GPU_CHECK": "1"}
    proc = subprocess.run(
        [
            str(REPO / ".venv" / "bin" / "python"),
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/unit/test_liger_gpu.py",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if torch.cuda.is_available() and importlib.util.find_spec("liger_kernel"):
        pytest.skip("this machine has CUDA and liger-kernel: the test runs for real")
    assert proc.returncode != 0 and "the GPU check runs the Liger test" in proc.stdout, proc.stdout[-2000:]
