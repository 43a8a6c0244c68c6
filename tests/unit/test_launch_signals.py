"""SIGTERM to ``hf-fsdp2 train`` reaches the training processes, not the launcher: they stop cleanly (a checkpoint,
or a running export finished) and the launcher ends without its own SignalException traceback.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

# A launcher like torch elastic's: a SIGTERM to it is an exception (a traceback); its exit is its worker's.
LAUNCHER = """
import signal, subprocess, sys
def die(signum, frame):
    raise RuntimeError("SignalException: the launcher got SIGTERM")
signal.signal(signal.SIGTERM, die)
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
sys.exit(worker.wait())
"""
# A training process: SIGTERM asks it to stop at the next step boundary, and it exits 0.
WORKER = """
import pathlib, signal, sys, time
stop = []
signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))
pathlib.Path(sys.argv[1]).write_text("ready")
while not stop:
    time.sleep(0.01)
print("worker: saved and stopped", flush=True)
"""


def test_sigterm_to_hf_fsdp2_train_stops_the_training_processes_cleanly(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    launcher = tmp_path / "launcher.py"
    launcher.write_text(LAUNCHER)
    driver = (
        "import sys\nfrom hf_fsdp2 import launch\n"
        f"launch.launch_command = lambda *a, **k: [sys.executable, {str(launcher)!r}, {WORKER!r}, {str(ready)!r}]\n"
        "sys.exit(launch.run_train('sft', []))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", driver], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.time() + 60
        while not ready.exists() and time.time() < deadline:
            time.sleep(0.02)
        assert ready.exists()
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output
    assert "SIGTERM passed to the 1 training process(es)" in output and "worker: saved and stopped" in output
    assert "Traceback" not in output and "SignalException" not in output
