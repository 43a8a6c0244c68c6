"""The test session's launch server (tests/support/launch_server.py): a served run is the run torchrun starts
(its environment, torch.distributed from env://, the caller's variables), a failing rank ends the run and is
reported with its output, and nothing of one run reaches the next."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from support import launch

# slow: it launches the real torchrun twice to compare; the full suite (CI) runs it, --quick does not.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not launch._server_enabled(), reason="HF_FSDP2_TEST_LAUNCH_SERVER=0"),
]

_KEYS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "MASTER_ADDR",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
)

_REPORT = """
import json, os, sys
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
seen_before = getattr(torch, "_touched_by_a_run", False)  # torch is imported by the server, before any fork
torch._touched_by_a_run = True
sys.stdout.write("REPORT " + json.dumps({
    "env": {k: os.environ.get(k) for k in %r}, "sum": total.item(), "argv": sys.argv[1:],
    "name": __name__, "fault": os.environ.get("HF_FSDP2_FAULT"), "seen_before": seen_before,
}) + "\\n")  # one write: the ranks share the stream, and PYTHONUNBUFFERED splits print()'s text from its newline
dist.destroy_process_group()
"""


def _reports(stdout: str) -> list[dict]:
    return sorted(
        (
            json.loads(line.removeprefix("REPORT "))
            for line in stdout.splitlines()
            if line.startswith("REPORT ")
        ),
        key=lambda r: int(r["env"]["RANK"]),
    )


def test_a_served_run_is_the_run_torchrun_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "report.py"
    script.write_text(_REPORT % (_KEYS,))
    monkeypatch.setenv(
        "HF_FSDP2_FAULT", "marker-value"
    )  # the caller's environment at launch time reaches the ranks
    served = _reports(launch.torchrun(script, ["--x", "1"], nproc=2, check=True).stdout)
    real = _reports(launch.torchrun(script, ["--x", "1"], nproc=2, real_launcher=True).stdout)
    assert len(served) == len(real) == 2
    for mine, theirs in zip(served, real, strict=True):
        assert mine["env"] == theirs["env"], (mine["env"], theirs["env"])
        assert (
            mine["sum"] == theirs["sum"] == 3.0
        )  # env:// rendezvous and a gloo all-reduce across both ranks
        assert mine["argv"] == theirs["argv"] == ["--x", "1"] and mine["name"] == "__main__"
        assert mine["fault"] == theirs["fault"] == "marker-value"
    # A module changed by one run is as the server imported it in the next (each run is a fresh fork).
    again = _reports(launch.torchrun(script, [], nproc=2, check=True).stdout)
    assert [r["seen_before"] for r in served + again] == [False] * 4


def test_a_failing_rank_ends_the_run_and_is_reported(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text(
        "import os, time, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "if dist.get_rank() == 1:\n"
        "    raise ValueError('rank one gives up')\n"
        "dist.barrier()  # rank 0 would wait here for gloo's 30-minute timeout\n"
    )
    start = time.perf_counter()
    with pytest.raises(AssertionError) as failed:
        launch.torchrun(script, [], nproc=2, timeout=120, check=True)
    assert time.perf_counter() - start < 60
    text = str(failed.value)
    assert "ValueError: rank one gives up" in text and "rank exit codes [" in text, text[-3000:]
    # Looked at rather than raised: the status torchrun gives a failed run (1), with the rank's own words.
    for real in (False, True):
        proc = launch.torchrun(script, [], nproc=2, timeout=120, check=False, real_launcher=real)
        assert proc.returncode == 1 and "ValueError: rank one gives up" in proc.stderr, (
            real,
            proc.stderr[-3000:],
        )
    # The server is still there for the next run.
    script.write_text("import sys\nprint('alone', len(sys.argv))\n")
    assert "alone 1" in launch.python(script, [], check=True).stdout


def test_a_served_accelerate_launch_is_the_run_accelerate_launch_starts(tmp_path: Path) -> None:
    """accelerate_launch(served=True): the ranks get what the real ``accelerate launch`` of the config gives them
    (torchrun's variables and accelerate's ACCELERATE_* / FSDP_* ones), and rendezvous as its ranks do."""
    script = tmp_path / "report.py"
    script.write_text(
        _REPORT.replace(
            "for k in %r}",
            "for k in sorted(os.environ) if k in %r or k.startswith(('ACCELERATE_', 'FSDP_'))}",
        )
        % (_KEYS,)
    )
    config = "accelerate_configs/fsdp2_cpu.yaml"
    served = _reports(launch.accelerate_launch(config, script, ["--x", "1"], served=True).stdout)
    real = _reports(launch.accelerate_launch(config, script, ["--x", "1"]).stdout)
    assert len(served) == len(real) == 2
    for mine, theirs in zip(served, real, strict=True):
        assert mine["env"]["FSDP_VERSION"] == "2" and mine["env"]["ACCELERATE_USE_FSDP"] == "true", mine[
            "env"
        ]
        assert mine["env"] == theirs["env"], (mine["env"], theirs["env"])
        assert mine["sum"] == theirs["sum"] == 3.0 and mine["argv"] == theirs["argv"] == ["--x", "1"]
