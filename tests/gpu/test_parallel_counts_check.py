"""The parallel counts checks of `bash scripts/gpu_check.sh` (context parallel + Muon needs 2 CUDA GPUs, tensor
parallel 4: NCCL refuses two ranks on one device; ``--gpu-dry-run`` validates their commands anywhere).

``bench/gpu_bench_parallel.py --shape 1b --cp 2 --seq 8192 --optim muon``: Llama-3.2-1B's shape, all-to-all context
parallel over the 2 GPUs (bf16, regional compile, full activation checkpointing, the chunked loss), Muon on the
decoder matrices. The bench counts one more step's collectives (CommDebugMode) and prints them next to its seconds;
here they are held to their formulas: the step's all-to-alls are context parallel's, 4 per decoder layer (q, k, v
gathered, the output scattered) in the forward, again in the checkpointed recompute and once back, plus Muon's, 2
per bucket of owner rounds (hf_fsdp2/train/muon_exchange.py) where one round at a time took 2 per round. It fails
when the run fails or a count leaves its formula (a collective added or lost on the GPU path).

``bench/gpu_bench_parallel.py --shape 1b --tp 2 --procs 4 --seq 8192``: tensor parallel 2 x FSDP2 2 (the library
refuses tp over every rank: FSDP2 needs a data dimension), the same GPU path; the step's all-gathers,
reduce-scatters and all-reduces held to :func:`~support.count_formulas.tp_step_collectives` (per layer 2 all-gathers + 2
reduce-scatters forward and backward, torchtitan's layout; the formula matched the same bench on 4 gloo ranks at 2
and 3 layers, tests/unit/test_gpu_formulas.py).

``bench/moe_bench.py ep --procs 2 --eps 1,2`` (the expert-parallel check, on any node: the bench trains
on 2 gloo ranks on the host, since NCCL refuses two ranks on one GPU and the bench has no GPU mode yet): a tiny
Qwen3-MoE flat and at ep 2, seconds and tokens/s beside the bytes each collective moved per step and rank, held to
:func:`~support.count_formulas.ep_step_bytes`: FSDP2's all-gather and reduce-scatter bytes exactly (flat: every expert gathered
twice a step; ep 2: none of them), no all-to-all flat, ep 2's within the band of the balanced exchange.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch
from support.count_formulas import ep_failures, ep_step_bytes, tp_step_collectives

from .conftest import Check
from .test_gpu_checks import REPO, load_script, run, tail

pytestmark = pytest.mark.gpu

NEEDS_TWO = "needs >= 2 CUDA GPUs: NCCL forbids two ranks on one device (this node has {n})"
NEEDS_FOUR = (
    "needs >= 4 CUDA GPUs: tensor parallel 2 x FSDP2 2 (tp over every rank is refused: FSDP2 needs a data "
    "dimension) and NCCL forbids two ranks on one device (this node has {n})"
)
LAYERS = 16  # the 1b shape's decoder layers
# The expert-parallel check's model and batches (tests/unit/test_gpu_formulas.py measured the same on CPU).
EP_MODEL = {
    "hidden": 64,
    "inter": 64,
    "layers": 2,
    "experts": 4,
    "top_k": 2,
    "vocab": 256,
    "rows": 2,
    "length": 64,
}
EP_ARGV = [f"--{k.replace('_', '-')}={v}" for k, v in EP_MODEL.items()] + ["--steps=4", "--warmup=1"]
SEQ, CHUNK = 8192, 4096  # the bench's row and its chunked loss's chunk (plan_loss(model, 4096))


def _bench_result(check: Check, argv: list[str], out: Path) -> dict:
    """Run ``bench/gpu_bench_parallel.py argv`` (one sequence length): its result, which must hold no error."""
    code, log = run(
        [sys.executable, str(REPO / "bench" / "gpu_bench_parallel.py"), *argv],
        check.work / "log",
        check.timeout(),
    )
    assert code == 0 and out.is_file(), f"gpu_bench_parallel exit code {code}:\n{tail(log)}"
    (result,) = json.loads(out.read_text())["results"]
    assert "error" not in result, result.get("traceback")
    return result


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
    result = _bench_result(check, argv, out)
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


@pytest.mark.budget(120)
@pytest.mark.gpus(4)
def test_tp_counts(check: Check) -> None:
    """tp 2 x FSDP2 2 at 8k tokens: tokens/s and seconds beside the step's counted collectives, held to
    tp_step_collectives (2 all-gathers + 2 reduce-scatters per layer and pass; fails on one more or one fewer)."""
    if not check.dry and torch.cuda.device_count() < 4:
        pytest.skip(NEEDS_FOUR.format(n=torch.cuda.device_count()))
    bench = load_script("gpu_bench_parallel", REPO / "bench" / "gpu_bench_parallel.py")
    out = check.work / "tp.json"
    argv = ["--shape", "1b", "--tp", "2", "--procs", "4", "--seq", str(SEQ), "--warmup", "2", "--steps", "3"]
    argv += ["--timeout-s", str(check.timeout(0.9)), "--out", str(out)]
    args = bench.parse_args(argv)  # the flags and the mesh are valid
    expected = tp_step_collectives(LAYERS, -(-(SEQ - 1) // CHUNK), args.ac)
    check.figures["command"] = "python bench/gpu_bench_parallel.py " + " ".join(argv)
    check.figures["expected_collectives_per_step"] = expected
    if check.dry:
        return
    result = _bench_result(check, argv, out)
    counts = result["collectives_per_step"]
    check.figures.update(
        {
            "step_s": result["step_s"],
            "tokens_per_s": result["tokens_per_s"],
            "mfu": result["mfu"],
            "collectives_per_step": counts,
            "tp": result.get("tp"),
        }
    )
    for kind, n in expected.items():
        check.figures[f"{kind}_per_step"] = counts.get(kind, 0)
        assert counts.get(kind, 0) == n, (kind, counts, expected)


class _Planned(Exception):
    """Raised by the dry run's stand-in for the bench's torchrun: the command line was built, nothing runs."""


@pytest.mark.budget(20)
def test_ep_counts(check: Check) -> None:
    """Flat FSDP2 vs ep 2 on 2 gloo ranks (bench/moe_bench.py ep): tokens/s and seconds per step beside the
    bytes per step and rank of each collective, held to ep_step_bytes. Fails when the bench fails, FSDP2's bytes
    differ from the formula by one byte (a layout that gathers the experts again, or pads otherwise), flat FSDP2
    sends an all-to-all, or ep 2's exchange leaves the band (doubled, another dtype). Skipped, with the reason,
    where torch lacks gloo or ``torch.distributed.all_gather_single`` (torch < 2.13: the bench counts FSDP2's
    gathers through it)."""
    import torch.distributed as dist

    bench = load_script("moe_bench", REPO / "bench" / "moe_bench.py")
    out = check.work / "ep.json"
    argv = ["ep", "--procs=2", "--eps=1,2", *EP_ARGV]
    check.figures["command"] = "python bench/moe_bench.py " + " ".join(argv)
    launches: list[list[str]] = []

    def planned(cmd: list[str], **kwargs: object) -> None:
        launches.append(cmd)
        raise _Planned

    with pytest.raises(_Planned):  # the bench's own parser takes the flags; its first torchrun is built
        bench.main(argv, run=planned)
    check.figures["first_launch"] = " ".join(launches[0][1:])
    if check.dry:
        return
    shape = argparse.Namespace(**EP_MODEL)
    with torch.device("meta"):  # shapes only
        model = bench._bench_model(shape)
    tokens = shape.rows * shape.length
    expected = {ep: ep_step_bytes(model, ranks=2, ep=ep, tokens=tokens) for ep in (1, 2)}
    check.figures["expected_bytes_per_step"] = expected
    if not dist.is_gloo_available() or not hasattr(dist, "all_gather_single"):
        pytest.skip(
            f"torch {torch.__version__} lacks gloo or dist.all_gather_single (bench/moe_bench.py counts by it)"
        )
    code, log = run(
        [sys.executable, str(REPO / "bench" / "moe_bench.py"), *argv, f"--json={out}"],
        check.work / "log",
        check.timeout(),
    )
    assert code == 0 and out.is_file(), f"moe_bench exit code {code}:\n{tail(log)}"
    rows = {r["ep"]: r for r in json.loads(out.read_text())}
    for ep, row in rows.items():
        check.figures.update({f"ep{ep}:step_s": row["step_s"], f"ep{ep}:tokens_per_s": row["tokens_per_s"]})
        check.figures.update({f"ep{ep}:{k}": v for k, v in row["bytes"].items()})
    check.figures["ep2:all_to_all_vs_balanced"] = (
        rows[2]["bytes"].get("all_to_all_single", 0) / expected[2]["all_to_all_single"]
    )
    failures = ep_failures({ep: row["bytes"] for ep, row in rows.items()}, expected)
    assert not failures, failures
