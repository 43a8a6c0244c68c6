"""bench/moe_bench.py's GPU mode, planned without a GPU (``gpu --dry-run``): the layouts it would launch for
Qwen3-30B-A3B's shape (ep 1 and 8 on 8 GPUs; the full model is planned at its real width, 2 of its 48 layers here to
keep the meta model small), each one's torchrun line, the FLOPs per device the recipe's meter would charge for the same
rows (MoE experts at top_k / experts), the run's own refusals before any launch, and ``--fit-gib``'s choice of the
most layers whose planned peak fits one GPU. Nothing is launched (the runner records calls)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from hf_fsdp2.observe.meter import StepMeter

REPO = Path(__file__).resolve().parents[2]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_moe_bench", REPO / "bench" / "moe_bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_dry_run_plans_ep_1_and_8_on_8_gpus_at_the_meters_flops(tmp_path: Path) -> None:
    bench, calls = _bench(), []
    out = tmp_path / "plan.json"
    bench.main(["gpu", "--dry-run", "--layers", "2", "--json", str(out)], run=lambda *a, **k: calls.append(a))
    assert calls == []  # nothing launched
    report = json.loads(out.read_text())
    assert (report["shape"], report["procs"], report["layers"], report["seq"]) == (
        "qwen3-30b-a3b",
        8,
        2,
        4096,
    )
    rows = {r["ep"]: r for r in report["results"]}
    assert sorted(rows) == [1, 8]
    assert rows[8]["mesh"].endswith(
        "expert parallel 8: each MoE layer's routed experts split over 8 ranks (tokens exchanged by all-to-all), "
        "each split sharded over 1 rank(s) (efsdp = dp_shard 8 x cp 1 / ep 8); every other parameter as above"
    )
    for ep, row in rows.items():
        assert "torch.distributed.run --nproc_per_node 8 " in row["launch"]
        assert f"moe_bench.py gpu-child --ep={ep} --procs=8 --shape=qwen3-30b-a3b --seq=4096" in row["launch"]
        assert "--layers=2" in row["launch"] and "--cpu" not in row["launch"]
    # The recipe's meter for the same rows: 8 ranks each counting one row of 4096 tokens, shared by 8 devices.
    flops = bench.gpu_flops(bench.meta_model(bench.gpu_config(bench.main.__globals__["argparse"].Namespace(
        shape="qwen3-30b-a3b", layers=2, seq=4096))))  # fmt: skip
    meter = StepMeter(
        flops=flops,
        world_size=1,
        device=torch.device("cpu"),
        total_steps=1,
        peak_flops=None,
        pad_token_id=None,
    )
    meter.start_step()
    meter.count([{"input_ids": torch.ones(1, 4096, dtype=torch.long)}])
    meter.end_step(target_tokens=4095, sync=False)
    meter.collect(step=1, loss_sum=torch.tensor(0.0))
    for row in rows.values():
        assert math.isclose(row["tflop_per_device_per_step"], meter.totals["flops"] / 1e12, abs_tol=1e-3)
    # The head, 2 layers of attention and router, 8/128 of their experts: not the whole 1.2B.
    assert 0.42 < rows[1]["active_params_b"] < 0.43


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--eps", "1,3"], "ep_size=3 does not divide dp_shard_size x cp_size = 8 x 1 = 8"),
        (["--procs", "6", "--eps", "6"], "ep_size=6 does not divide the model's 128 routed experts"),
    ],
)
def test_dry_run_refuses_what_the_run_would_refuse(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _bench().main(["gpu", "--dry-run", "--layers", "1", *argv], run=lambda *a, **k: None)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_fit_gib_picks_the_most_layers_whose_planned_peak_fits_one_gpu() -> None:
    bench = _bench()
    args = bench.main.__globals__["argparse"].Namespace(
        shape="tiny", layers=None, seq=64, rows=1, ac="full", procs=1, fit_gib=None
    )
    peaks = []
    for layers in (1, 2):
        args.layers = layers
        peaks.append(bench.planned_peak(bench.gpu_config(args), args, 1))
    assert peaks[0] < peaks[1]
    between = (peaks[0] + peaks[1]) / 2 / 0.9 / 2**30  # GiB whose 90% lies between the two peaks
    args.layers = None
    assert bench.largest_fitting_layers(args, between) == 1
    assert bench.largest_fitting_layers(args, peaks[1] / 0.9 / 2**30 * 1.01) == 2
