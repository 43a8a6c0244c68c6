"""The run summary's tokens/s, TFLOP/s and MFU leave torch.compile's seconds out of the step time."""

from __future__ import annotations

import pytest
import torch

import hf_fsdp2.observe.meter as meter_module
from hf_fsdp2.observe.flops import FlopsModel
from hf_fsdp2.observe.meter import StepMeter
from hf_fsdp2.observe.summary import format_summary, run_summary


def _meter(monkeypatch: pytest.MonkeyPatch, step_seconds: list[float]) -> tuple[StepMeter, float]:
    now = [100.0]
    monkeypatch.setattr(meter_module.time, "perf_counter", lambda: now[0])
    fm = FlopsModel(non_embedding_params=1000, layers=2, heads=4, head_dim=8)
    meter = StepMeter(
        flops=fm, world_size=2, device=torch.device("cpu"), total_steps=3, peak_flops=1e6, pad_token_id=0
    )
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "labels": torch.tensor([[-100, 6, 7, 8]])}
    for seconds in step_seconds:
        meter.start_step()
        meter.count([batch])
        now[0] += seconds
        meter.end_step(target_tokens=3, sync=True)
    meter.collect(step=len(step_seconds), loss_sum=torch.tensor(1.0))
    return meter, fm.for_sequences([4]) * len(step_seconds)  # one process: its flops are the gathered sum


def _summary(meter: StepMeter, compile_stats: dict[str, float] | None) -> dict:
    return run_summary(
        meter,
        first_step=1,
        last_step=3,
        wall_seconds=50.0,
        last_record=None,
        last_eval=None,
        export_dir=None,
        compile_stats=compile_stats,
    )


def test_throughput_and_mfu_exclude_the_compile_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    # Three steps of 11, 1 and 1 s; the first spent 10 s compiling: training itself took 3 s.
    meter, flops = _meter(monkeypatch, [11.0, 1.0, 1.0])
    stats = {"compile_s": 10.0, "compiled_graphs": 3.0, "recompiles": 0.0, "recompile_limit_hits": 0.0}
    summary = _summary(meter, stats)
    assert summary["wall_time_s"] == 50.0 and summary["train_time_s"] == pytest.approx(13.0)  # kept whole
    assert summary["tokens_per_s"] == pytest.approx(12 / 3.0)
    assert summary["tokens_per_s_per_device"] == pytest.approx(12 / 3.0 / 2)
    assert summary["target_tokens_per_s"] == pytest.approx(9 / 3.0)
    assert summary["tflops_per_device"] == pytest.approx(flops / 3.0 / 2 / 1e12)
    assert summary["mfu"] == pytest.approx(flops / 3.0 / 2 / 1e6)
    assert summary["tokens_per_s_including_compile"] == pytest.approx(12 / 13.0)
    assert summary["throughput_excludes_compile"] is True
    assert any("leave the compile time out" in line for line in format_summary(summary))
    # Without compile, the same meter gives the rates over the whole step time.
    eager = _summary(meter, None)
    assert eager["tokens_per_s"] == pytest.approx(12 / 13.0) and "tokens_per_s_including_compile" not in eager


def test_compile_time_not_inside_the_steps_is_not_taken_off(monkeypatch: pytest.MonkeyPatch) -> None:
    meter, _ = _meter(monkeypatch, [2.0, 1.0, 1.0])
    summary = _summary(meter, {"compile_s": 30.0, "recompile_limit_hits": 1.0})  # more than the 4 s of steps
    assert summary["throughput_excludes_compile"] is False
    assert summary["tokens_per_s"] == pytest.approx(12 / 4.0)  # never the 1e12 tok/s of a clamped 1e-9 s
    text = "\n".join(format_summary(summary))
    assert "include it" in text and "recompile limit hit 1 time(s)" in text
