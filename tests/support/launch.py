"""Launching multi-process runs (torchrun, accelerate launch) from tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SFT = REPO / "recipes" / "sft.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["HF_HUB_OFFLINE"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["PYTHONPATH"] = str(REPO / "tests") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run(cmd: list[str], timeout: int, check: bool) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"command failed ({proc.returncode}): {' '.join(cmd)}\n--- stdout ---\n{proc.stdout[-6000:]}"
            f"\n--- stderr ---\n{proc.stderr[-8000:]}"
        )
    return proc


def torchrun(script: Path | str, args: list[str], *, nproc: int = 2, timeout: int = 600, check: bool = True):
    """``torchrun --nproc_per_node N script args`` on a free port."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(script),
        *args,
    ]
    return _run(cmd, timeout, check)


def accelerate_launch(
    config_file: str, script: Path | str, args: list[str], *, timeout: int = 600, check: bool = True
):
    """``accelerate launch --config_file F script args`` on a free port."""
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / config_file),
        "--main_process_port",
        str(free_port()),
        str(script),
        *args,
    ]
    return _run(cmd, timeout, check)


def python(script: Path | str, args: list[str], *, timeout: int = 600, check: bool = True):
    """A plain ``python script args`` in a fresh process."""
    return _run([sys.executable, str(script), *args], timeout, check)
