"""Restarts by torch's elastic agent, in one process (hf_fsdp2/elastic/; end to end: tests/recipes/test_restarts.py):
the launcher's restarts against the recipe's, where an attempt resumes, the restarted attempt's own store namespace,
the run folder under ``resume_from_checkpoint: auto``, how an attempt's end is told, the words of the last attempt,
and ``max_restarts`` reaching the launcher through ``hf-fsdp2 train``."""

from __future__ import annotations

import json
import re
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
import yaml

from hf_fsdp2.checkpoint.layout import ATTEMPT_DIR, RESTARTS_FILE
from hf_fsdp2.checkpoint.run_dir import claim_auto
from hf_fsdp2.config import CONFIG_NAME, ConfigError
from hf_fsdp2.elastic import attempts
from hf_fsdp2.elastic.agent import AgentLaunch, attempt_init_method, check_max_restarts, resume_setting
from hf_fsdp2.elastic.progress import PROGRESS, Progress
from hf_fsdp2.export.card import render_model_card
from hf_fsdp2.launch import launch_command, recipe_max_restarts


def _agent(attempt: int = 0, max_restarts: int = 3) -> AgentLaunch:
    return AgentLaunch.from_env(
        {"TORCHELASTIC_RESTART_COUNT": str(attempt), "TORCHELASTIC_MAX_RESTARTS": str(max_restarts)}
    )


def test_the_launchers_restarts_and_a_recipe_that_asks_for_others() -> None:
    assert AgentLaunch.from_env({}) == AgentLaunch(under_agent=False)
    launch = _agent(1, 3)
    assert (launch.attempt, launch.max_restarts, launch.restarts_left) == (1, 3, 2)
    assert launch.describe() == "attempt 2 of 4 (max_restarts 3, restart 1)"
    check_max_restarts(None, launch)
    check_max_restarts(3, launch)
    check_max_restarts(0, AgentLaunch(under_agent=False))
    with pytest.raises(
        ConfigError, match=r"max_restarts=2 in the recipe, but the launcher restarts the run 3 time"
    ):
        check_max_restarts(2, launch)
    with pytest.raises(ConfigError, match=r"Add --max_restarts 2 to the launcher's command line"):
        check_max_restarts(2, _agent(0, 0))
    with pytest.raises(ConfigError, match=r"max_restarts=2 but no elastic agent started this process"):
        check_max_restarts(2, AgentLaunch(under_agent=False))


def test_where_an_attempt_resumes() -> None:
    # A first attempt with restarts: auto unless the recipe says otherwise.
    assert resume_setting(None, overwrite=False, launch=_agent(0, 2)).resume == "auto"
    assert resume_setting("latest", overwrite=False, launch=_agent(0, 2)).resume == "latest"
    first = resume_setting(None, overwrite=True, launch=_agent(0, 2))
    assert (first.resume, first.overwrite) == (None, True)  # overwritten once, by the first attempt
    assert resume_setting(None, overwrite=False, launch=AgentLaunch(under_agent=False)).resume is None
    # A restarted attempt continues the run, whatever the first one was told.
    later = resume_setting("/x/checkpoint-2", overwrite=True, launch=_agent(1, 2))
    assert (later.resume, later.overwrite) == ("auto", False)
    assert later.note is not None
    assert (
        "resume_from_checkpoint=/x/checkpoint-2 and overwrite_output_dir=true applied to the first attempt"
        in (later.note)
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_restarted_attempt_rendezvouses_under_a_name_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent's store outlives the attempts: the previous attempt's keys (here "rank_1") must not be read as this
    one's (before, env:// read them: a restart's ranks connected to a dead rank's port)."""
    port = _free_port()
    server = dist.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=10))
    server.set("rank_1", "a dead rank's address")
    env = {
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "3",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert attempt_init_method(_agent(0, 3)) is None  # a first attempt: torch's env://
    url = attempt_init_method(_agent(2, 3))
    assert url == "hf-fsdp2-attempt://"
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert attempt_init_method(_agent(2, 3)) is None  # a store of the attempt's own: nothing stale in it
    store, rank, world = next(dist.rendezvous(url, timeout=timedelta(seconds=10)))
    assert (rank, world) == (0, 1)
    assert not store.check(["rank_1"])  # the stale key is not this attempt's
    store.set("rank_0", "mine")
    assert server.get("/hf_fsdp2/attempt_2/rank_0") == b"mine"


def _leftovers(folder: Path, **config: object) -> None:
    folder.mkdir()
    (folder / CONFIG_NAME).write_text(yaml.safe_dump({"seed": 42, "model_name_or_path": "m", **config}))
    (folder / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    (folder / RESTARTS_FILE).write_text(json.dumps({"restarts": [{"restart": 1}]}))


def test_auto_starts_fresh_over_its_own_leftovers_and_refuses_another_runs(tmp_path: Path) -> None:
    current = {"seed": 42, "model_name_or_path": "m"}
    assert claim_auto(tmp_path / "none", current) is None  # no folder: a fresh start
    mine = tmp_path / "mine"
    _leftovers(mine)
    assert claim_auto(mine, current) is None
    assert not (mine / "metrics.jsonl").exists() and (mine / RESTARTS_FILE).exists()  # the history is kept
    other = tmp_path / "other"
    _leftovers(other, seed=7)
    with pytest.raises(
        ConfigError, match=r"holds another run's outputs \(metrics.jsonl.*seed: checkpoint 7 vs now 42"
    ):
        claim_auto(other, current)
    finished = tmp_path / "finished"
    _leftovers(finished)
    (finished / "summary.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"holds a finished run \(summary.json\) and no checkpoint"):
        claim_auto(finished, current)


def test_progress_tells_the_step_and_the_span_an_error_left() -> None:
    progress = Progress()
    progress.begin_step(5)
    assert (progress.step, progress.completed, progress.first_step) == (5, 4, 5)
    with pytest.raises(OSError), progress.unwatched("checkpoint save"):
        assert progress.snapshot()[1] == "checkpoint save"
        raise OSError("disk")
    assert (progress.phase, progress.where()) == ("step", "checkpoint save")
    progress.begin_step(6)
    assert len(progress.durations) == 1


def _end(folder: Path, rank: int, kind: str, message: str, **fields: object) -> None:
    (folder / ATTEMPT_DIR).mkdir(parents=True, exist_ok=True)
    record = {
        "rank": rank,
        "step": 3,
        "completed": 2,
        "phase": "step",
        "kind": kind,
        "message": message,
        **fields,
    }
    (folder / ATTEMPT_DIR / f"rank{rank}.json").write_text(json.dumps(record))


def test_how_an_attempt_ended_is_told_from_its_ranks_records(tmp_path: Path) -> None:
    # A killed rank says nothing: the rank that lost it names it.
    _end(tmp_path, 0, "lost", "lost [1]", gone=[1], where="all_reduce in read_step_counts")
    entry = attempts.take_previous(tmp_path, launch=_agent(1), resumed_step=2, last_logged_step=2, world=2)
    assert entry is not None
    assert entry["cause"].startswith("rank 1 ended without an error of its own: killed by a signal")
    assert "rank 0 lost it during all_reduce in read_step_counts" in entry["cause"]
    assert (entry["ranks"], entry["step"], entry["steps_lost"]) == ([1], 3, 0)
    assert not (tmp_path / ATTEMPT_DIR).exists()  # taken
    # The same error on every rank (an agreed one); then the history says the failure repeats.
    for rank in (0, 1):
        _end(tmp_path, rank, "error", "ConfigError: bad record 17")
    entry = attempts.take_previous(tmp_path, launch=_agent(2), resumed_step=2, last_logged_step=2, world=2)
    assert entry is not None and entry["cause"] == "every rank: ConfigError: bad record 17"
    history = attempts.read_history(tmp_path)
    assert len(history) == 2 and attempts.repeated(history) == 2
    line = attempts.describe_restart(entry, history, _agent(2))
    assert line.startswith(
        "restart 2 of 3: the previous attempt ended during step 3: every rank: ConfigError"
    )
    assert "The last 2 attempts all ended at step 3" in line and "(1 restart(s) left)" in line
    # Nobody wrote: every rank was killed; the steps it got through are the metrics it logged.
    entry = attempts.take_previous(tmp_path, launch=_agent(3), resumed_step=2, last_logged_step=5, world=2)
    assert entry is not None and entry["kind"] == "unknown" and entry["steps_lost"] == 3
    assert "no rank recorded why" in entry["cause"]
    # A first attempt after none: nothing to say.
    assert (
        attempts.take_previous(
            tmp_path / "new", launch=_agent(0), resumed_step=0, last_logged_step=0, world=2
        )
        is None
    )


def test_the_last_attempt_says_no_restart_is_left_and_whether_the_failure_repeats(tmp_path: Path) -> None:
    assert attempts.with_restart_note("boom", AgentLaunch(under_agent=False), tmp_path) == "boom"
    assert (
        "The launcher restarts the run (2 of max_restarts 3 restart(s) left)"
        in attempts.with_restart_note("boom", _agent(1, 3), tmp_path)
    )
    history = [
        {"launch": "restart", "restart": r, "step": 4, "cause": f"rank 1: RuntimeError: bad batch {r}"}
        for r in (1, 2)
    ]
    (tmp_path / RESTARTS_FILE).write_text(json.dumps({"restarts": history}))
    PROGRESS.reset(tmp_path)
    PROGRESS.begin_step(4)
    same = attempts.with_restart_note("boom", _agent(2, 2), tmp_path)
    assert same.startswith("boom. No restart is left: all 3 attempts (max_restarts 2) ended during step 4")
    # The cause is in the line itself: the launcher's report may name a rank that only lost the failing one.
    assert (
        "not transient and another restart would end there too (the previous attempt's cause: rank 1: "
        in same
    )
    assert "RuntimeError: bad batch 2). Fix its cause" in same
    PROGRESS.begin_step(5)
    moved = attempts.with_restart_note("boom", _agent(2, 2), tmp_path)
    assert (
        "the 3 attempts (max_restarts 2) ended at steps 4, 4, 5 (the previous attempt's cause: rank 1: "
        in moved
    )
    PROGRESS.reset(None)


def test_the_restarts_are_in_the_model_card() -> None:
    restart = {
        "restart": 1,
        "step": 3,
        "cause": "rank 1 ended without an error",
        "resumed_from_step": 2,
        "steps_lost": 0,
    }
    card = render_model_card(
        {"model_name_or_path": "m", "dataset_name": "d"}, metrics=None, restarts=[restart]
    )
    assert "## Restarts" in card and "| 1 | 3 | rank 1 ended without an error | 2 | 0 |" in card
    assert "## Restarts" not in render_model_card({"model_name_or_path": "m"}, metrics=None)


def test_hf_fsdp2_train_gives_the_recipes_max_restarts_to_the_launcher(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("max_restarts: 3\n")
    assert recipe_max_restarts(["--config", str(recipe)]) == 3
    assert recipe_max_restarts([f"--config={recipe}", "--max_restarts", "5"]) == 5  # the command line wins
    assert recipe_max_restarts(["--learning_rate", "1e-5"]) is None
    with pytest.raises(ValueError, match="max_restarts='many' must be a whole number"):
        recipe_max_restarts(["--max_restarts=many"])
    command = launch_command("sft", ["--config", str(recipe)], num_processes=2, gpus=0, max_restarts=3)
    assert command[command.index("--max_restarts") + 1] == "3"
    assert command.index("--max_restarts") < command.index("hf_fsdp2.methods")  # the launcher's flag
    assert "--max_restarts" not in launch_command("sft", [], num_processes=2, gpus=0)


# ---------------------------------------------------------------------------------------------------
# The hang watchdog (hf_fsdp2/elastic/watchdog.py)
# ---------------------------------------------------------------------------------------------------


def test_the_hang_bound_from_the_key_or_the_step_time() -> None:
    from hf_fsdp2.config.restarts import HANG_FACTOR, HANG_FLOOR_S
    from hf_fsdp2.elastic.watchdog import hang_bound

    assert hang_bound(0, [1.0]) is None  # hang_timeout 0: no watchdog
    assert hang_bound(42.0, []) == 42.0
    assert hang_bound(None, []) is None  # nothing measured yet: the attempt's first step
    assert hang_bound(None, [0.2, 0.5]) == HANG_FLOOR_S
    assert hang_bound(None, [0.2, 200.0]) == HANG_FACTOR * 200.0


def test_where_a_stack_waits_in_a_collective_or_not() -> None:
    import traceback

    from hf_fsdp2.elastic.watchdog import where_in

    def frame(filename: str, name: str, line: int) -> traceback.FrameSummary:
        return traceback.FrameSummary(filename, line, name)

    agent = [frame("/x/torch/distributed/elastic/multiprocessing/errors/__init__.py", "wrapper", 1)]
    waiting = [
        *agent,
        frame("/x/hf_fsdp2/train/step.py", "read_step_counts", 226),
        frame("/x/hf_fsdp2/collectives.py", "all_reduce_sum", 208),
        frame("/x/torch/distributed/c10d_logger.py", "wrapper", 81),
        frame("/x/torch/distributed/distributed_c10d.py", "all_reduce", 3000),
    ]
    assert where_in(waiting) == (True, "all_reduce in read_step_counts (train/step.py:226)")
    stalled = [*agent, frame("/x/tests/support/elastic_rank.py", "_at_step", 52)]
    assert where_in(stalled) == (
        False,
        "_at_step (support/elastic_rank.py:52)",
    )  # the agent's wrapper is no collective


def test_the_hang_line_names_where_each_rank_is_and_whom_the_others_wait_for(tmp_path: Path) -> None:
    from hf_fsdp2.elastic.watchdog import hang_message

    answers = {
        0: {
            "host": "a",
            "collective": True,
            "where": "all_reduce in read_step_counts (train/step.py:226)",
            "watched": 31,
        },
        1: {"host": "a", "collective": False, "where": "next in load (data/loader.py:9)", "watched": 30},
        2: None,
    }
    beats = {2: {"step": 5, "phase": "step", "time": 0.0}}
    line = hang_message(5, "hang_timeout 30 s", answers, tmp_path, beats=beats)
    assert line.startswith(
        "hang at step 5: no step finished for 31.0 s (hang_timeout 30 s): rank 0 (a) waits in"
    )
    assert "rank 1 (a) is not in a collective: next in load (data/loader.py:9)" in line
    assert (
        "rank 2: no answer (stuck in native code holding the GIL, stopped, or its machine lost; its last"
        in line
    )
    assert "; the others wait for ranks 1, 2." in line and f"{tmp_path}/hang-step5-rank<r>.txt" in line


def test_the_flight_recorder_is_turned_on_and_a_users_setting_kept(tmp_path: Path) -> None:
    from hf_fsdp2.elastic.watchdog import flight_recorder_env, flight_recorder_trace

    env = {"TORCH_FR_BUFFER_SIZE": "100"}
    set_here = flight_recorder_env(tmp_path, env)
    assert env["TORCH_FR_BUFFER_SIZE"] == "100" and "TORCH_FR_BUFFER_SIZE=100" not in set_here
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "nccl_trace_rank_")
    assert isinstance(
        flight_recorder_trace(), bytes
    )  # torch's dump (its entries: the 2-rank test reads them)


GIL_HELD = r"""
import re, sys, time
from pathlib import Path
from hf_fsdp2.elastic.progress import PROGRESS
from hf_fsdp2.elastic.watchdog import Watchdog
PROGRESS.reset(Path(sys.argv[1]))
PROGRESS.begin_step(1)
PROGRESS.begin_step(2)  # a watched step
Watchdog(timeout_s=0.5, output_dir=Path(sys.argv[1]), rank=0, world=1, poll_s=0.1, grace_s=1.0).start()
time.sleep(0.3)  # the watchdog arms faulthandler's timer
re.match(r"(a+)+$", "a" * 64 + "b")  # native code that holds the GIL: the watchdog's thread never runs again
"""


def test_a_main_thread_that_holds_the_gil_is_dumped_and_ended_by_faulthandler(tmp_path: Path) -> None:
    import subprocess
    import sys
    import time

    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", GIL_HELD, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1, proc.stderr[-2000:]  # faulthandler's exit
    assert (
        "Timeout (0:00:0" in proc.stderr and "<string>" in proc.stderr
    )  # every thread's stack, the main one's
    assert time.monotonic() - start < 60


# ---------------------------------------------------------------------------------------------------
# Preemption inside the kill window (hf_fsdp2/elastic/kill_window.py)
# ---------------------------------------------------------------------------------------------------


def test_the_kill_window_verdict_has_its_figures_and_offers_what_fits() -> None:
    from hf_fsdp2.elastic.kill_window import KillWindow, verdict

    fits, words = verdict(
        step_s=1.2, save_s=0.8, window_s=30, measured_save=True, save_steps=500, save_async=False
    )
    assert fits and words == (
        "preemption: a SIGTERM is answered at the next step boundary with a checkpoint: a step (1.2 s) + a save "
        "(0.8 s, measured) + the exit (2.0 s) = 4.0 s, within the 30.0 s kill window (kill_window)"
    )
    # A long step: no boundary before the SIGKILL; a cadence that bounds the loss, or a longer grace.
    fits, words = verdict(
        step_s=40, save_s=5, window_s=30, measured_save=True, save_steps=500, save_async=False
    )
    assert not fits and "a step alone is longer than the window" in words
    assert "save_steps: 15 (a checkpoint every ~600 s" in words and "save_steps is 500 now" in words
    assert "#SBATCH --signal=TERM@57" in words and "terminationGracePeriodSeconds: 57" in words
    # A large checkpoint: said at start-up from its size (96 GB over 8 ranks at 0.5 GB/s: 24 s per rank).
    window = KillWindow(window_s=30, checkpoint_bytes=96 * 10**9, world=8, save_steps=0, save_async=False)
    assert window.at_start() is None  # 24 s + the exit fits, without the step
    window = KillWindow(window_s=20, checkpoint_bytes=96 * 10**9, world=8, save_steps=0, save_async=False)
    start = window.at_start()
    assert start is not None and "a save (24.0 s, estimated at 0.5 GB/s per rank)" in start
    assert (
        "(one checkpoint: 96.0 GB over 8 rank(s))" in start
        and "no periodic checkpoint now (save_steps 0)" in start
    )
    # After two steps the verdict once; again only when the first measured save changes it.
    window = KillWindow(window_s=30, checkpoint_bytes=96 * 10**9, world=8, save_steps=100, save_async=False)
    assert window.check([9.0]) is None
    said = window.check([9.0, 5.0])
    assert said is not None and not said[0] and "estimated" in said[1]  # 5 + 24 + 2 > 30
    assert window.check([9.0, 5.0, 5.0]) is None
    window.saved(3.0)  # a fast disk after all
    said = window.check([9.0, 5.0, 5.0, 5.0])
    assert said is not None and said[0] and "a save (3.0 s, measured)" in said[1]
    assert window.check([9.0, 5.0, 5.0, 5.0, 5.0]) is None


# ---------------------------------------------------------------------------------------------------
# Several nodes
# ---------------------------------------------------------------------------------------------------


def test_a_node_that_did_not_come_back_is_named_from_the_last_attempts_records(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What hf-fsdp2 train's launcher says when a restart's rendezvous times out: the node whose ranks the others
    lost (by process, or by the address in the transport's error), else every node but its own."""
    places = [
        {"rank": 0, "node": 0, "host": "a", "addr": "10.0.0.1"},
        {"rank": 1, "node": 0, "host": "a", "addr": "10.0.0.1"},
        {"rank": 2, "node": 1, "host": "b", "addr": "10.0.0.2"},
        {"rank": 3, "node": 1, "host": "b", "addr": "10.0.0.2"},
    ]
    attempts.record_layout(tmp_path, places)
    assert attempts.read_layout(tmp_path) == places
    assert attempts.lost_nodes(tmp_path, 0) == "node 1 (b: ranks 2, 3) did not come back"
    _end(tmp_path, 0, "lost", "Connection reset by peer [10.0.0.2]:4121", step=7)
    assert attempts.lost_nodes(tmp_path, 0) == "node 1 (b: ranks 2, 3) did not come back, lost during step 7"
    assert "no record of the last attempt's nodes" in attempts.lost_nodes(tmp_path / "none", 0)
    # The launcher's own line (its rendezvous, not the ranks, timed out), with the node from the run's records.
    import accelerate.commands.launch as accelerate_launch
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    from hf_fsdp2 import launch

    def timed_out(args: object) -> None:
        raise RendezvousTimeoutError("join timed out")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(accelerate_launch, "launch_command", timed_out)
        argv = [launch.ACCELERATE_LAUNCH, "--machine_rank", "0", "-m", "hf_fsdp2.methods", "sft"]
        assert launch.launcher_main([*argv, "--output_dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        "hf-fsdp2 train: exit status 1: the restart's rendezvous timed out on node 0: node 1 (b: ranks 2, 3) did not "
        "come back, lost during step 7. Start it again (or replace it) and run the same command on every node"
    ), err


def test_hf_fsdp2_train_on_several_nodes_with_restarts_takes_the_c10d_config() -> None:
    command = launch_command(
        "sft", [], num_machines=2, machine_rank=1, main_process_ip="10.0.0.1", gpus=8, max_restarts=2
    )
    assert command[command.index("--config_file") + 1].endswith("fsdp2_multinode_elastic.yaml")
    config = yaml.safe_load(Path(command[command.index("--config_file") + 1]).read_text())
    assert (
        config["rdzv_backend"] == "c10d" and config["same_network"] is False
    )  # accelerate passes the endpoint
    plain = launch_command("sft", [], num_machines=2, machine_rank=1, main_process_ip="10.0.0.1", gpus=8)
    assert plain[plain.index("--config_file") + 1].endswith("fsdp2_multinode.yaml")


def test_a_restarted_attempt_names_the_ranks_that_do_not_join(monkeypatch: pytest.MonkeyPatch) -> None:
    from hf_fsdp2.elastic.agent import NodeLostError, check_arrival

    port = _free_port()
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": "0",
        "WORLD_SIZE": "2",
        "GROUP_RANK": "0",
    }
    env |= {"GROUP_WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "False"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert (
        check_arrival(_agent(0, 2), timeout_s=1, layout=[]) is None
    )  # a first attempt: the rendezvous met them
    layout = [{"rank": 1, "node": 1, "host": "b"}]
    with pytest.raises(
        NodeLostError, match=r"restart 1\): rank 1 \(node 1, b\) did not join within 1 s: its node"
    ):
        check_arrival(_agent(1, 2), timeout_s=1, layout=layout)


def test_a_long_save_is_no_hang_and_the_step_after_it_is_watched_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A save 4x the bound inside a watched step is not named; the step's own time after it is, and the stacks go to
    a stderr that has no file descriptor (pytest's capture, a notebook) without the watchdog's thread dying on it."""
    import os
    import time

    from hf_fsdp2.elastic.watchdog import HANG_EXIT, Watchdog

    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", exits.append)  # the watchdog's end of the rank, in this test's process
    progress = Progress()
    progress.reset(tmp_path)
    progress.begin_step(1)
    progress.begin_step(2)  # a watched step
    watchdog = Watchdog(timeout_s=0.5, output_dir=tmp_path, rank=0, world=1, progress=progress, poll_s=0.05)
    watchdog.start()
    try:
        with progress.unwatched("checkpoint save"):
            time.sleep(2.0)  # 4x the bound, in a save: not a hang
        assert exits == []
        deadline = time.monotonic() + 30
        while not exits and time.monotonic() < deadline:  # the step again: a hang
            time.sleep(0.05)
    finally:
        watchdog.stop()
    assert exits == [HANG_EXIT]
    err = capsys.readouterr().err
    found = re.search(
        r"hf_fsdp2 error: hang at step 2: no step finished for (\d+\.\d) s \(hang_timeout 0\.5 s\)", err
    )
    assert found, err[-2000:]
    # The step's watched time alone (one decimal): past the bound, and without the save's 2 s.
    assert 0.5 <= float(found.group(1)) < 2.0, found.group(0)
    assert (tmp_path / "debug" / "hang-step2-rank0.txt").is_file()
