"""What the GPU benches share to run one ``torchrun`` per configuration and read what its rank 0 wrote (no torch
import: the benches load torch in their ranks). bench/ is not a package: the benches import this as a top-level module,
bench/ put on ``sys.path`` first, also when a test loads them by path."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_child(run: Callable[..., Any], cmd: list[str], out: Path, timeout_s: float) -> dict[str, Any]:
    """``run(cmd, ...)`` (subprocess.run, or a test's stand-in) with the checkout on PYTHONPATH: the JSON its rank 0
    wrote to ``out``, else the exit code and the end of its stderr, or the timeout that stopped it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    try:
        proc = run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"stopped after {timeout_s:.0f} s"}
    if out.is_file():
        return dict(json.loads(out.read_text()))
    return {"error": f"exit code {proc.returncode}", "traceback": proc.stderr[-3000:]}
