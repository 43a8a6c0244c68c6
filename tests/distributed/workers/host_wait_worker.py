"""Rank 0's long host work against a short default-group timeout, then a step's host reads with its stop check.

Used by tests/distributed/test_host_waits.py, on 2 gloo ranks built by ``build_accelerator`` (the recipe's
start-up, which creates the host group) with ``ddp_timeout`` = ``--timeout`` seconds:

1. waits: ``rank0_first`` (rank 0 sleeps, then rank 1 sleeps: each side waits for the other), ``rank0_decides``
   (rank 0 sleeps) and the export check's wait (rank 0 sleeps, then ``broadcast_object`` of its findings, as
   ``verify_export`` and ``verify_adapter`` do after the reload), each sleep longer than ``--timeout``;
2. steps: three SFT steps on the fake ``cuda:0`` of tests/support/devices.py with the collectives' device set
   to it (as NCCL's is), each followed by the SIGTERM check as ``RunState.after_step`` makes it; rank 1 gets
   its stop request after step 1. Each rank writes its host reads per step and stop answers to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from support.devices import DEVICE, FakeAccelerator

from hf_fsdp2 import collectives
from hf_fsdp2.checkpoint.preemption import StopRequest
from hf_fsdp2.config.plans import CompilePlan, ShardingPlan
from hf_fsdp2.model import load_model
from hf_fsdp2.parallel.accelerator import build_accelerator
from hf_fsdp2.train.loss import LossPlan
from hf_fsdp2.train.step import StepSettings, forward_backward

LIBRARY = ("hf_fsdp2", "train", "run", "observe")  # the folders of hf_fsdp2's files in a read's place


def _sleep_then(seconds: float, value: str) -> str:
    time.sleep(seconds)
    return value


def waits(sleep: float) -> dict[str, object]:
    rank = collectives.rank()
    started = time.perf_counter()
    # Rank 0 "tokenises" for `sleep` seconds while rank 1 waits; then rank 1 reads the cache (`sleep` seconds
    # too) while rank 0 waits for its result.
    first = collectives.rank0_first(lambda: _sleep_then(sleep, f"cache read by rank {rank}"))
    collectives.rank0_decides(lambda: time.sleep(sleep) if rank == 0 else None)
    found: dict[str, float] = {}
    if rank == 0:  # rank 0 reloads the export in a subprocess, then sends its findings
        time.sleep(sleep)
        found = {"noise": 0.0}
    found = collectives.broadcast_object(found)
    collectives.barrier()  # the default group is still alive after the long waits
    return {"rank0_first": first, "found": found, "waited_s": time.perf_counter() - started}


def steps(model_dir: str) -> dict[str, object]:
    collectives._device = lambda: DEVICE  # type: ignore[assignment]  # NCCL's default group takes GPU tensors
    model = load_model(model_dir)
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(collectives.rank()))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    stop = StopRequest()  # not installed: the test sets the flag a SIGTERM handler would set
    mode = FakeAccelerator()
    mode.put_module(model)
    reads: list[list[str]] = []
    answers: list[bool] = []
    collectives.host_barrier()  # both ranks have loaded the model before the first step's collective
    with mode:
        for step in (1, 2, 3):
            before = len(mode.host_reads)
            forward_backward(model, [batch], StepSettings(LossPlan()), DEVICE)
            answers.append(stop.should_stop())
            # hf_fsdp2's own reads (transformers' are not ours to change), as in tests/unit/test_device_paths.py
            ours = [
                (what, where) for what, where in mode.host_reads[before:] if where.split("/")[0] in LIBRARY
            ]
            reads.append([what for what, _ in ours])
            if step == 1 and collectives.rank() == 1:
                stop.requested = True  # SIGTERM on rank 1 only, between steps 1 and 2
    return {"reads": reads, "stop": answers}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--timeout", type=int, required=True)
    ap.add_argument("--sleep", type=float, required=True)
    args = ap.parse_args()
    acc = build_accelerator(
        ShardingPlan(),
        mixed_precision="no",
        compile_plan=CompilePlan(),
        timeout_s=args.timeout,
        host_timeout_s=600,
    )
    result = {
        "host_group_timeout": collectives.host_group_timeout(),
        **waits(args.sleep),
        **steps(args.model),
    }
    Path(args.out, f"rank{collectives.rank()}.json").write_text(json.dumps(result))
    acc.end_training()


if __name__ == "__main__":
    main()
