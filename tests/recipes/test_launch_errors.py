"""A recipe's error under the real launchers: ``hf-fsdp2 train`` shows the rank's one line and
the exit status, without accelerate's / torch elastic's 20-30 line traceback; a bare ``accelerate launch`` keeps
that report, and the rank says first, in one line, that it follows and can be ignored. A rank killed with kill -9
mid-run is named by the surviving rank and by the launcher's line, without a traceback.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import yaml
from support.launch import REPO, SFT, _env, accelerate_launch, free_port
from support.tiny import WORDS, make_tiny_llama_dir

# Refused when the config is read, before any model loads (an unknown key): a quick failure on every rank.
BAD = {"model_name_or_path": "unused", "dataset_name": "unused", "lerning_rate": 1e-4, "max_steps": 1}


def _recipe(tmp_path: Path) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({**BAD, "output_dir": str(tmp_path / "run")}))
    return path


def test_hf_fsdp2_train_shows_the_ranks_error_and_the_exit_status_only(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "hf_fsdp2.cli",
        "train",
        "--config",
        str(_recipe(tmp_path)),
        "--main_process_port",
        str(free_port()),
    ]
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


# A reward function that kills its own process (SIGKILL, as kill -9 or the OOM killer) on rank 1, in the rollout.
DYING_REWARDS = (
    "import os, signal\n"
    "def dying(prompts, completions, **kw):\n"
    "    if os.environ.get('RANK') == '1':\n"
    "        os.kill(os.getpid(), signal.SIGKILL)\n"
    "    return [float(len(c)) for c in completions]\n"
)


def test_a_rank_killed_during_the_grpo_rollout_is_named_in_one_line(tmp_path: Path) -> None:
    """Rank 1 killed with SIGKILL while scoring its completions; rank 0 used to fail in the gather that follows with a 38-line traceback ending in gloo's "Connection reset by peer [127.0.0.1]:N", never naming rank 1.
    Now rank 0 says which rank stopped and in which collective, the launcher how it ended; no traceback."""
    (tmp_path / "dying_rewards.py").write_text(DYING_REWARDS)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": " ".join(WORDS[i : i + 3])}) + "\n" for i in range(8)))
    model = make_tiny_llama_dir(tmp_path / "model", seed=3)
    args = [
        "--model_name_or_path",
        str(model),
        "--dataset_name",
        str(data),
        "--output_dir",
        str(tmp_path / "run"),
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "2",
        "--num_generations",
        "2",
        "--max_completion_length",
        "3",
        "--max_length",
        "32",
        "--mixed_precision",
        "no",
        "--reward_funcs",
        "dying_rewards:dying",
        "--export_verify",
        "false",
    ]
    cmd = [
        sys.executable,
        "-m",
        "hf_fsdp2.cli",
        "train",
        "grpo",
        *args,
        "--main_process_port",
        str(free_port()),
    ]
    env = dict(_env(), PYTHONPATH=f"{tmp_path}:{_env()['PYTHONPATH']}")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    err = proc.stderr
    errors = [line for line in err.splitlines() if line.startswith("hf_fsdp2 error:")]
    assert len(errors) == 1, err[-4000:]
    assert errors[0].startswith("hf_fsdp2 error: rank 1 stopped (its process ended: killed by a signal"), (
        errors[0]
    )
    assert (
        "rank 0 lost its connection to it during all_gather_object in rollout (hf_fsdp2/methods/grpo/"
        in errors[0]
    )
    assert re.search(
        r"^hf-fsdp2 train: exit status 1: rank 1 stopped \(killed by signal 9, SIGKILL", err, re.M
    ), err[-4000:]
    assert "Traceback" not in err and "Connection reset" not in err, err[-4000:]
    assert proc.returncode == 1


# hf-fsdp2 train's own process on a machine without a GPU driver (libcuda made unloadable here): the packaged CPU
# config is chosen without importing torch (~2 s of CPU before accelerate's launcher, which imports it anyway, starts).
NO_DRIVER = """
import ctypes, sys
real = ctypes.CDLL
def cdll(name, *args, **kwargs):
    if name == "libcuda.so.1":
        raise OSError(f"{name}: cannot open shared object file")
    return real(name, *args, **kwargs)
ctypes.CDLL = cdll
from hf_fsdp2.launch import launch_command
cmd = launch_command("sft", ["--config", "r.yaml"])
print(cmd[cmd.index("--config_file") + 1].rsplit("/", 1)[-1], cmd[cmd.index("--num_processes") + 1], "torch" in sys.modules)
"""


def test_the_launching_process_finds_no_gpu_without_importing_torch() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", NO_DRIVER], cwd=REPO, env=_env(), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    if Path("/dev/kfd").exists():  # AMD's GPU device: torch (ROCm) is asked, as before
        assert proc.stdout.split()[-1] == "True", proc.stdout
    else:
        assert proc.stdout.strip() == "fsdp2_cpu.yaml 2 False", proc.stdout
