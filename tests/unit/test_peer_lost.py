"""A rank whose process ends mid-run (kill -9, the out-of-memory killer) is named in one line:
the surviving rank sees its transport's "Connection reset by peer" and looks up which rank's process is gone, the
launcher's line says how it ended. One process each; the run end to end is in tests/recipes/test_launch_errors.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from hf_fsdp2 import collectives, launch

GLOO = (
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:30386: Connection reset by peer. "
    "This is typically caused by a remote worker hanging or bugs in the application."
)


@pytest.fixture
def peers(monkeypatch: pytest.MonkeyPatch) -> subprocess.Popen[bytes]:
    """Rank 1 is a child process of this one (rank 0), on this machine; rank 2 is on another machine."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    here = collectives._machine()
    monkeypatch.setitem(
        collectives._HOST, "peers", [(here, os.getpid()), (here, child.pid), ("elsewhere:1", child.pid)]
    )
    yield child
    child.kill()
    child.wait()


def test_a_killed_rank_on_this_machine_is_named(peers: subprocess.Popen[bytes]) -> None:
    assert collectives.gone_ranks(wait_s=0.2) == []  # alive; rank 2's pid is another machine's
    peers.send_signal(signal.SIGKILL)
    time.sleep(0.2)  # not reaped: a zombie, as a rank is until its launcher polls it
    assert collectives.gone_ranks(wait_s=1.0) == [1]
    peers.wait()
    assert collectives.gone_ranks(wait_s=1.0) == [1]  # reaped: no /proc entry at all


def test_a_lost_connection_is_recognised_through_the_errors_it_caused(peers: subprocess.Popen[bytes]) -> None:
    peers.send_signal(signal.SIGKILL)
    try:
        try:
            raise RuntimeError(GLOO)
        except RuntimeError as err:
            raise ValueError("failed while scoring the completions") from err
    except ValueError as err:
        assert collectives.peer_lost(err) == ("", [1])
    assert collectives.peer_lost(RuntimeError("CUDA out of memory")) is None
    assert collectives.peer_lost(ValueError("connection reset by peer")) is None  # not a transport's error


def test_the_line_names_the_rank_and_the_collective_or_says_a_peer() -> None:
    named = collectives.peer_lost_message(
        "all_gather_object in rollout (hf_fsdp2/methods/grpo/step.py:106)", [1], 0
    )
    assert named.startswith(
        "rank 1 stopped (its process ended: killed by a signal, e.g. kill -9 or the out-of-memory"
    )
    assert "rank 0 lost its connection to it during all_gather_object in rollout" in named
    unknown = collectives.peer_lost_message("all_reduce", [], 3)
    assert unknown.startswith(
        "a peer rank's connection closed during all_reduce (rank 3): another rank stopped"
    )
    assert "\n" not in named + unknown


def _failure(rank: int, exitcode: int, tmp_path: Path) -> ProcessFailure:
    return ProcessFailure(
        local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(tmp_path / "none")
    )


def _launcher_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], failures: dict[int, ProcessFailure]
) -> tuple[int, str]:
    """The status and the one line of ``hf-fsdp2 train``'s launcher when the ranks end with ``failures``."""
    import accelerate.commands.launch as accelerate_launch

    def failed(args: object) -> None:
        raise ChildFailedError("sft", failures)

    monkeypatch.setattr(accelerate_launch, "launch_command", failed)
    status = launch.launcher_main([launch.ACCELERATE_LAUNCH, "-m", "hf_fsdp2.methods", "sft"])
    return status, capsys.readouterr().err.strip()


def test_the_launchers_line_says_a_rank_was_killed_by_a_signal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Before, "exit status 1 (rank 1 failed first; ...); its error is above": a killed rank has no error above."""
    for error_stamped_first in (False, True):
        # The agent stamps a killed rank when it notices it: often after rank 0 wrote its error (seen in a whole run).
        failures = {1: _failure(1, -signal.SIGKILL, tmp_path), 0: _failure(0, 1, tmp_path)}
        failures[0].timestamp, failures[1].timestamp = (100, 101) if error_stamped_first else (101, 100)
        status, line = _launcher_line(monkeypatch, capsys, failures)
        assert status == 1
        assert line.startswith(
            "hf-fsdp2 train: exit status 1: rank 1 stopped (killed by signal 9, SIGKILL: kill -9, or the out-of-memory"
        ), line
        assert line.endswith("(rank 0: 1, rank 1: SIGKILL)") and "its error is above" not in line


def test_a_rank_the_agent_ended_with_sigterm_is_not_named_as_the_cause(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Rank 0 stopped on a config error (status 2); the agent then sent SIGTERM to rank 1, still running. A whole run
    named rank 1 "stopped without an error of its own" when its stamp came first: rank 0's error is the cause."""
    for error_stamped_first in (False, True):
        failures = {1: _failure(1, -signal.SIGTERM, tmp_path), 0: _failure(0, 2, tmp_path)}
        failures[0].timestamp, failures[1].timestamp = (100, 101) if error_stamped_first else (101, 100)
        status, line = _launcher_line(monkeypatch, capsys, failures)
        assert status == 2
        assert line.startswith(
            "hf-fsdp2 train: exit status 2 (rank 0 failed first; rank 0: 2, rank 1: SIGTERM)"
        ), line


def test_a_rank_that_only_lost_the_failing_one_is_not_named_as_the_cause(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Rank 1 raised its own error; rank 0 lost it and exited 1 too, in the agent's same poll: the same status, the
    same stamp, and rank 0 first. Before, "rank 0 failed first" (no error of rank 0's above); now rank 1, from the
    ranks' records in the run folder (a record of an earlier launch does not count)."""
    import json
    import os

    from hf_fsdp2.checkpoint.layout import ATTEMPT_DIR

    records = tmp_path / "run" / ATTEMPT_DIR
    records.mkdir(parents=True)
    (records / "rank0.json").write_text(json.dumps({"rank": 0, "kind": "lost"}))
    (records / "rank1.json").write_text(json.dumps({"rank": 1, "kind": "error"}))
    import accelerate.commands.launch as accelerate_launch

    def failed(args: object) -> None:
        failures = {0: _failure(0, 1, tmp_path), 1: _failure(1, 1, tmp_path)}
        failures[0].timestamp = failures[1].timestamp = 100
        for path in records.iterdir():  # written during this launch
            os.utime(path)
        raise ChildFailedError("sft", failures)

    monkeypatch.setattr(accelerate_launch, "launch_command", failed)
    argv = [launch.ACCELERATE_LAUNCH, "-m", "hf_fsdp2.methods", "sft", "--output_dir", str(tmp_path / "run")]
    assert launch.launcher_main(argv) == 1
    line = capsys.readouterr().err.strip()
    assert line.startswith("hf-fsdp2 train: exit status 1 (rank 1 failed first; rank 0: 1, rank 1: 1)"), line
    # An earlier launch's records (older than this launch) say nothing about this one: the earlier stamp decides.
    for path in records.iterdir():
        os.utime(path, (1, 1))

    def failed_again(args: object) -> None:
        failures = {0: _failure(0, 1, tmp_path), 1: _failure(1, 1, tmp_path)}
        failures[0].timestamp = failures[1].timestamp = 100
        raise ChildFailedError("sft", failures)

    monkeypatch.setattr(accelerate_launch, "launch_command", failed_again)
    assert launch.launcher_main(argv) == 1
    assert capsys.readouterr().err.strip().startswith("hf-fsdp2 train: exit status 1 (rank 0 failed first;")
