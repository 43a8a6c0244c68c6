"""gpu_bench.py's TRL runners, the parent's side: whether one can run here, the model folder TRL loads,
the ``accelerate launch`` command with TRL's FSDP2 file, and the launch itself (its measurements come back
as JSON from `gpu_bench_trl_child`, which runs in the launched process).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from gpu_bench_work import build

# The entry point the launched process runs (with --trl-child), and the checkout it runs from.
ENTRY = Path(__file__).resolve().with_name("gpu_bench.py")
REPO = ENTRY.parents[1]
# What a one-process run of gpu_bench.py put in its environment (hf_fsdp2's accelerator) and the launcher
# of a TRL child sets itself.
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def trl_config_file() -> Path | None:
    """TRL's own accelerate config for FSDP2 (``trl/accelerate_configs/fsdp2.yaml``), None without TRL."""
    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "accelerate_configs" / "fsdp2.yaml"
    return path if path.exists() else None


def trl_unavailable(kernels: str, on_cuda: bool) -> str | None:
    """Why a TRL runner cannot run here (None: it can)."""
    missing = [name for name in ("trl", "datasets") if importlib.util.find_spec(name) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (pip install trl==1.16.0 datasets)"
    if trl_config_file() is None:
        return "trl is installed without its accelerate_configs/fsdp2.yaml"
    if kernels == "liger":
        reasons = [] if on_cuda else ["Liger's Triton kernels need a CUDA device (none in this run)"]
        if importlib.util.find_spec("liger_kernel") is None:
            reasons.append("liger-kernel not installed (pip install liger-kernel)")
        if reasons:
            return "; ".join(reasons)
    return None


def save_model_folder(args: argparse.Namespace, device: torch.device, folder: Path) -> None:
    """The runners' random init (same config, seed and device), saved as a model folder TRL loads by path,
    with a word-level tokenizer that only names the pad and eos tokens (the data are token ids)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    model = build(args, device)
    model.save_pretrained(folder)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    words = Tokenizer(WordLevel({"<pad>": 0, "<eos>": 1, "<unk>": 2}, unk_token="<unk>"))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(folder)


def trl_launch_command(args: argparse.Namespace, item: str, folder: Path, out: Path, port: int) -> list[str]:
    """``accelerate launch`` with TRL's FSDP2 config file on one process, running this script's TRL child."""
    config_file = trl_config_file()
    assert config_file is not None  # checked by trl_unavailable
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(config_file),
        "--num_processes",
        "1",
        "--num_machines",
        "1",
        "--main_process_port",
        str(port),
        "--mixed_precision",
        "no" if args.cpu else "bf16",
        "--dynamo_backend",
        "no",
        # CPU: the threads this process computes with (accelerate launch would give a GPU-style launch one)
        *(["--num_cpu_threads_per_process", str(torch.get_num_threads())] if args.cpu else []),
        str(ENTRY),
        "--trl-child",
        item,
        "--trl-model",
        str(folder),
        "--trl-out",
        str(out),
        "--shape",
        args.shape,
        "--seq",
        str(args.seq),
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
        *(["--cpu"] if args.cpu else []),
    ]


def run_trl(
    args: argparse.Namespace, item: str, folder: Path, work: Path, timeout_s: float
) -> dict[str, Any]:
    """Launch one TRL runner (a fresh ``accelerate launch`` process) and read its measurements back; the
    process (the launcher and its child: one process group) is stopped after ``timeout_s``."""
    out = work / f"trl-{item.replace(':', '-')}.json"
    out.unlink(missing_ok=True)
    cmd = trl_launch_command(args, item, folder, out, free_port())
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCH_VARS and not k.startswith(("ACCELERATE_", "FSDP_"))
    }
    env.update(
        {
            "PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]),
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
    )
    if args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    launch = "accelerate launch " + " ".join(cmd[3:])
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        return {"error": f"stopped after {timeout_s:.0f} s: {log[-1000:]}", "launch": launch}
    if proc.returncode != 0 or not out.exists():
        oom = "out of memory" in log.lower()
        error = "out of memory" if oom else f"exit code {proc.returncode}"
        return {"error": f"{error}: {log[-1500:]}", "launch": launch}
    return {**json.loads(out.read_text()), "launch": launch}
