"""The flat FSDP2 reference that tests/distributed/test_context_parallel.py and test_hsdp.py both compare against.

One tiny Llama (seed 5), 64 chat records (seed 5), a 4-rank flat FSDP2 SFT run with checkpoints at 2 and 4, and a
one-process run of the same global micro-batches (8 examples each: the reference for float noise). Both files
launched exactly these two runs with exactly these arguments; now the first pytest worker of the session that asks
makes them and any other worker waits on a file lock and reads them (a worker alone makes them for itself).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.launch import SFT, torchrun

STEPS = 4
# Runs whose checkpoints no test resumes: without it every run saves one at its last step (save_steps 500 by default).
NO_CHECKPOINT = ("--save_steps", "0")


def sft_args(model: Path, data: Path, out: Path, batch: int, *extra: str) -> list[str]:
    """The recipe arguments of every run compared with the reference (fp32, accumulation 2, sequential order)."""
    return [
        "--model_name_or_path",
        str(model),
        "--dataset_name",
        str(data),
        "--output_dir",
        str(out),
        "--max_steps",
        str(STEPS),
        "--per_device_train_batch_size",
        str(batch),
        "--gradient_accumulation_steps",
        "2",
        "--max_length",
        "64",
        "--mixed_precision",
        "no",
        "--logging_steps",
        "1",
        "--learning_rate",
        "1e-3",
        "--train_sampling_strategy",
        "sequential",
        *extra,
    ]


@dataclass(frozen=True)
class FlatReference:
    model: Path
    data: Path
    flat: Path  # the 4-rank run's folder: metrics.jsonl, checkpoint-2, checkpoint-4, model.safetensors
    flat_log: str  # its stdout and stderr
    single: list[dict]  # the one-process run's metrics


_made: dict[str, FlatReference] = {}


def _session_root(factory: pytest.TempPathFactory) -> Path:
    """The folder all workers of this session share (xdist: the parent of each worker's own base folder)."""
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def flat_reference(factory: pytest.TempPathFactory) -> FlatReference:
    """The reference, made once per session. Read it; a run that resumes from it links its checkpoint."""
    if "ref" in _made:
        return _made["ref"]
    from hf_fsdp2.observe.logs import read_metrics
    from support.tiny import make_tiny_llama_dir, write_chat_jsonl

    root = _session_root(factory) / "flat_reference"
    root.mkdir(exist_ok=True)
    with open(root.parent / "flat_reference.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held until the runs are done (the other worker waits here)
        done = root / "done.json"
        if not done.is_file():
            for partial in ("model", "flat", "single"):  # a worker that failed half-way left these
                shutil.rmtree(root / partial, ignore_errors=True)
            model = make_tiny_llama_dir(root / "model", seed=5)
            data = write_chat_jsonl(root / "chat.jsonl", 64, seed=5)
            # The export is compared by the tests, its verification's line is not read: not verified.
            proc = torchrun(
                SFT,
                sft_args(model, data, root / "flat", 2, "--save_steps", "2", "--export_verify", "false"),
                nproc=4,
            )
            torchrun(
                SFT,
                sft_args(model, data, root / "single", 8, "--export_verify", "false", *NO_CHECKPOINT),
                nproc=1,
            )
            done.write_text(json.dumps({"flat_log": proc.stdout + proc.stderr}))
    _made["ref"] = FlatReference(
        model=root / "model",
        data=root / "chat.jsonl",
        flat=root / "flat",
        flat_log=json.loads(done.read_text())["flat_log"],
        single=read_metrics(root / "single" / "metrics.jsonl"),
    )
    return _made["ref"]
