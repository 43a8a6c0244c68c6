"""scripts/setup.sh picks the torch build by itself: CUDA (PyPI's default, at least the floor of hf_fsdp2/compat.py,
so a node's own CUDA torch is kept) where nvidia-smi lists a GPU, the pinned CPU build otherwise, HF_FSDP2_TORCH
over both."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from hf_fsdp2.compat import FLOORS

REPO = Path(__file__).resolve().parents[2]


def _spec(tmp_path: Path, *, gpu: bool, override: str | None = None) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "nvidia-smi"
    if gpu:
        fake.write_text('#!/bin/sh\necho "GPU 0: NVIDIA H200 (UUID: GPU-0)"\n')
    else:  # a driver tool that lists no GPU (or fails) is a CPU machine
        fake.write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "HF_FSDP2_TORCH"}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    if override:
        env["HF_FSDP2_TORCH"] = override
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "setup.sh"), "--print-torch-spec"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def test_the_torch_build_follows_the_machine(tmp_path: Path) -> None:
    assert _spec(tmp_path, gpu=True) == "torch>=2.11" == f"torch>={'.'.join(map(str, FLOORS['torch']))}"
    assert _spec(tmp_path, gpu=False) == "torch==2.13.0"
    assert _spec(tmp_path, gpu=True, override="torch==2.12.0+cu126") == "torch==2.12.0+cu126"
