"""Launching multi-process runs (torchrun, accelerate launch) from tests."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SFT = REPO / "recipes" / "sft.py"


# Parallel pytest workers (xdist) each take ports from their own block below the kernel's ephemeral range
# (32768 and up on Linux), so two workers' launches never pick the same rendezvous port, and no port the
# kernel hands out for gloo's own connections.
_PORT_BLOCK = 1500
_PORT_BASE = 20000


def _port_candidates() -> list[int]:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) if worker.isdigit() else 0
    start = _PORT_BASE + (index % 8) * _PORT_BLOCK
    ports = list(range(start, start + _PORT_BLOCK))
    random.shuffle(ports)
    return ports


def free_port() -> int:
    """A port no process listens on now, from this pytest worker's own block."""
    for port in _port_candidates():
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in this worker's block of {_PORT_BLOCK} from {_PORT_BASE}")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["HF_HUB_OFFLINE"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["PYTHONPATH"] = str(REPO / "tests") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _log_launch(cmd: list[str], seconds: float, returncode: int) -> None:
    """With HF_FSDP2_TEST_LAUNCH_LOG=file, one JSON line per launch: which test, what, how long (profiling)."""
    log = os.environ.get("HF_FSDP2_TEST_LAUNCH_LOG")
    if log:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
        script = next((Path(c).name for c in cmd[1:] if c.endswith(".py")), " ".join(cmd[1:3]))
        line = {"test": test, "script": script, "s": round(seconds, 1), "rc": returncode}
        with open(log, "a") as f:
            f.write(json.dumps(line) + "\n")


def _run(cmd: list[str], timeout: int, check: bool) -> subprocess.CompletedProcess[str]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)
    _log_launch(cmd, time.perf_counter() - start, proc.returncode)
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
