"""Waits behind rank 0's long host work go over the host (gloo) group with its own timeout, and the per-step
SIGTERM check agrees on every rank without reading the device.

On a GPU the other ranks used to wait for rank 0's tokenisation and the export's reload inside an NCCL
collective, which the watchdog ends after ``ddp_timeout``; here the default group's timeout is a few seconds and
rank 0's work (a sleep standing in for it) lasts longer: the run completes only if those waits are not on the
default group. The same run counts the host reads of a step with its stop check on the fake ``cuda:0``.
"""

from __future__ import annotations

import json
from pathlib import Path

from support.launch import torchrun
from support.tiny import make_tiny_llama_dir

WORKER = Path(__file__).parent / "workers" / "host_wait_worker.py"
TIMEOUT_S, SLEEP_S = 4, 6  # the default group's timeout, and rank 0's work: longer


def test_rank0_work_longer_than_ddp_timeout_and_the_stop_check(tmp_path: Path) -> None:
    model = make_tiny_llama_dir(tmp_path / "model", seed=3)
    out = tmp_path / "out"
    out.mkdir()
    args = ["--out", str(out), "--model", str(model), "--timeout", str(TIMEOUT_S), "--sleep", str(SLEEP_S)]
    torchrun(WORKER, args, nproc=2, timeout=180)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r, result in enumerate(ranks):
        assert result["host_group_timeout"] == 600
        # rank0_first returns each rank's own read of the cache; the export check's findings are rank 0's.
        assert result["rank0_first"] == f"cache read by rank {r}" and result["found"] == {"noise": 0.0}
        assert (
            result["waited_s"] >= 3 * SLEEP_S
        )  # each rank sat through waits longer than the default timeout
        # One host read per step, the step's token counts: the stop flag never becomes a device tensor.
        assert result["reads"] == [["tolist()"]] * 3, result["reads"]
        # SIGTERM on rank 1 after step 1: every rank stops at step 2.
        assert result["stop"] == [False, True, True]
