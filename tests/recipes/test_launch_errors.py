"""A recipe's error under the real launchers (issue 40 item 10): ``hf-fsdp2 train`` shows the rank's one line and
the exit status, without accelerate's / torch elastic's 20-30 line traceback; a bare ``accelerate launch`` keeps
that report, and the rank says first, in one line, that it follows and can be ignored.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml
from support.launch import REPO, SFT, _env, accelerate_launch, free_port

# Refused when the config is read, before any model loads (an unknown key): a quick failure on every rank.
BAD = {"model_name_or_path": "unused", "dataset_name": "unused", "lerning_rate": 1e-4, "max_steps": 1}


def _recipe(tmp_path: Path) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({**BAD, "output_dir": str(tmp_path / "run")}))
    return path


def test_hf_fsdp2_train_shows_the_ranks_error_and_the_exit_status_only(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "hf_fsdp2.cli", "train", "--config", str(_recipe(tmp_path)),
           "--main_process_port", str(free_port())]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    err = proc.stderr
    errors = [line for line in err.splitlines() if line.startswith("hf_fsdp2 error:")]
    assert len(errors) == 1 and "lerning_rate" in errors[0], err[-3000:]
    assert "Traceback" not in err and "ChildFailedError" not in err and "Root Cause" not in err, err[-3000:]
    assert "failed (exitcode" not in err  # torch elastic's log line: the one below says it
    # Every rank raised the error: whichever exited first is named (the other may be ended by the launcher).
    assert re.search(r"^hf-fsdp2 train: exit status 2 \(rank [01] failed first; rank 0: ", err, re.M), err[
        -3000:
    ]
    assert "launcher's report that follows" not in err  # no report follows here
    assert proc.returncode == 2


def test_a_bare_accelerate_launch_says_first_that_the_launchers_report_can_be_ignored(tmp_path: Path) -> None:
    proc = accelerate_launch(
        "accelerate_configs/fsdp2_cpu.yaml", SFT, ["--config", str(_recipe(tmp_path))], check=False
    )
    ours = [line for line in proc.stderr.splitlines() if line.startswith("hf_fsdp2")]
    assert len(ours) == 2, proc.stderr[-3000:]
    assert ours[0].startswith(
        "hf_fsdp2: the run stopped with exit status 2 on the error below; the launcher's report"
    )
    assert "can be ignored" in ours[0] and ours[1].startswith("hf_fsdp2 error:") and "lerning_rate" in ours[1]
    assert proc.stderr.index(ours[1]) < proc.stderr.index("Traceback")  # the launcher's report, after both
