"""scripts/cpu_seconds.sh counts the CPU of processes its command starts and never waits for (a launcher's ranks, a
server it forks), which rusage-based timers such as /usr/bin/time miss."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cpu_seconds.sh"
BUSY = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\n"


def _writable_cgroup() -> bool:
    return os.access("/sys/fs/cgroup/cpuacct", os.W_OK) or (
        Path("/sys/fs/cgroup/cgroup.controllers").is_file() and os.access("/sys/fs/cgroup", os.W_OK)
    )


@pytest.mark.skipif(not _writable_cgroup(), reason="needs a writable cgroup with CPU accounting (root)")
def test_a_process_nobody_waits_for_is_counted(tmp_path: Path) -> None:
    done = tmp_path / "done"
    # An inner shell starts the busy loop in the background and exits at once: the loop is orphaned (its parent is
    # then init), so no rusage of the command holds it; the outer shell polls a file instead of waiting.
    inner = f"({sys.executable} -c '{BUSY}'; touch {done}) &"
    shell = f'bash -c "{inner}"; while [ ! -f {done} ]; do sleep 0.05; done'
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(
        ["bash", str(SCRIPT), "busy", "bash", "-c", shell], capture_output=True, text=True, check=True
    ).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    name, cpu, wall, status = out.split()
    assert (name, status) == ("busy", "0")
    assert float(cpu) >= 0.6, out  # the busy loop's 0.6 s of process time, at least
    waited = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    assert waited < 0.6, waited  # what rusage saw: the loop was never waited for


def test_usage_and_a_failing_command_keep_their_status() -> None:
    usage = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True)
    assert usage.returncode == 2 and "usage: cpu_seconds.sh NAME COMMAND" in usage.stderr
    if _writable_cgroup():
        failed = subprocess.run(["bash", str(SCRIPT), "f", "false"], capture_output=True, text=True)
        assert failed.returncode == 1 and failed.stdout.split()[-1] == "1"
