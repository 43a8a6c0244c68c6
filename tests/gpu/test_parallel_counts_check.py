"""The parallel counts check of `bash scripts/gpu_check.sh` (needs 2 CUDA GPUs: NCCL refuses two ranks on one device;
``--gpu-dry-run`` validates its command anywhere).

``bench/gpu_bench_parallel.py --shape 1b --cp 2 --seq 8192 --optim muon``: Llama-3.2-1B's shape, all-to-all context
parallel over the 2 GPUs (bf16, regional compile, full activation checkpointing, the chunked loss), Muon on the
decoder matrices. The bench counts one more step's collectives (CommDebugMode) and prints them next to its seconds;
here they are held to their formulas: the step's all-to-alls are context parallel's, 4 per decoder layer (q, k, v
gathered, the output scattered) in the forward, again in the checkpointed recompute and once back, plus Muon's, 2
per bucket of owner rounds (hf_fsdp2/train/muon_exchange.py) where one round at a time took 2 per round. It fails
when the run fails or a count leaves its formula (a collective added or lost on the GPU path).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from .conftest import Check
from .test_gpu_checks import REPO, load_script, run, tail

pytestmark = pytest.mark.gpu

NEEDS_TWO = "needs >= 2 CUDA GPUs: NCCL forbids two ranks on one device (this node has {n})"
LAYERS = 16  # the 1b shape's decoder layers


@pytest.mark.budget(120)
@pytest.mark.gpus(2)
def test_parallel_counts(check: Check) -> None:
    """cp 2 + Muon at 8k tokens: tokens/s and seconds beside the step's counted collectives, held to the formulas."""
    if not check.dry and torch.cuda.device_count() < 2:
        pytest.skip(NEEDS_TWO.format(n=torch.cuda.device_count()))
    bench = load_script("gpu_bench_parallel", REPO / "bench" / "gpu_bench_parallel.py")
    out = check.work / "parallel.json"
    argv = ["--shape", "1b", "--cp", "2", "--seq", "8192", "--optim", "muon", "--warmup", "2", "--steps", "3"]
    argv += ["--timeout-s", str(check.timeout(0.9)), "--out", str(out)]
    bench.parse_args(argv)  # the flags and the mesh are valid
    check.figures["command"] = "python bench/gpu_bench_parallel.py " + " ".join(argv)
    if check.dry:
        return
    code, log = run(
        [sys.executable, str(REPO / "bench" / "gpu_bench_parallel.py"), *argv],
        check.work / "log",
        check.timeout(),
    )
    assert code == 0 and out.is_file(), f"gpu_bench_parallel exit code {code}:\n{tail(log)}"
    (result,) = json.loads(out.read_text())["results"]
    assert "error" not in result, result.get("traceback")
    counts = result["collectives_per_step"]
    muon = result["muon_all_to_alls_per_step"]
    check.figures.update(
        {
            "step_s": result["step_s"],
            "tokens_per_s": result["tokens_per_s"],
            "mfu": result["mfu"],
            "collectives_per_step": counts,
            "muon_all_to_alls_per_step": muon,
            "muon_all_to_alls_before_buckets": 2 * result["muon_rounds"],
        }
    )
    assert counts["all_to_all"] == LAYERS * 3 * 4 + muon, counts
    assert 2 <= muon < 2 * result["muon_rounds"], (muon, result["muon_rounds"])
