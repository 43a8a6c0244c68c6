"""The benchmark scripts run end to end at a tiny size (their figures come from full-size runs; see
bench/README.md). What must hold at any size is checked: the same work, and what each switch changes."""

from __future__ import annotations

import json
from pathlib import Path

from support.launch import REPO, python


def test_trainer_bench_runs_the_same_work_in_every_runner(tmp_path: Path):
    out = tmp_path / "tb.json"
    python(
        REPO / "bench" / "trainer_bench.py",
        ["--rounds", "1", "--steps", "3", "--warmup", "1", "--hidden", "64", "--layers", "2",
         "--batch-size", "8", "--max-length", "256", "--work", str(tmp_path / "work"), "--json", str(out)],
        timeout=900,
    )  # fmt: skip
    table = json.loads(out.read_text())["medians"]
    assert set(table) == {"hf_fsdp2", "hf_fsdp2_plain_ce", "hf_fsdp2_pf", "trainer", "trl"}
    losses = {name: row["final_loss"] for name, row in table.items()}
    # Same model, examples, order, batches and optimizer: the same loss after the last step.
    for name, loss in losses.items():
        assert abs(loss - losses["trainer"]) < 1e-3 * losses["trainer"], (name, losses)
    assert (
        abs(table["hf_fsdp2"]["padding_eff"] - table["trainer"]["padding_eff"]) < 1e-9
    )  # same padded batches
    assert table["hf_fsdp2_pf"]["padding_eff"] > 1.5 * table["trainer"]["padding_eff"]
    # The full [tokens x vocab] fp32 logits (vocab 49152) are what chunked cross entropy never builds.
    assert table["hf_fsdp2"]["peak_rss_gib"] < table["hf_fsdp2_plain_ce"]["peak_rss_gib"]


def test_memory_bench_orders_the_modes_and_halves_the_bytes_per_rank(tmp_path: Path):
    out = tmp_path / "mb.json"
    python(
        REPO / "bench" / "memory_bench.py",
        ["--hidden", "64", "--intermediate", "128", "--layers", "4", "--heads", "4", "--kv-heads", "2",
         "--vocab", "4096", "--seq", "1024", "--batch", "2", "--repeats", "1", "--worlds", "1,2",
         "--work", str(tmp_path / "work"), "--json", str(out)],
        timeout=900,
    )  # fmt: skip
    report = json.loads(out.read_text())
    modes = report["activations"]["modes"]
    assert (
        modes["full"]["activation_mib"] < modes["every_k"]["activation_mib"] < modes["none"]["activation_mib"]
    )
    assert (
        modes["full"]["activation_mib"]
        < modes["selective"]["activation_mib"]
        < modes["none"]["activation_mib"]
    )
    loss_paths = report["activations"]["loss_paths_mib"]
    assert loss_paths["chunked_1024"] < loss_paths["plain"]
    sharding = report["sharding"]
    # fp32 param + grad + two AdamW moments (+ AdamW's scalar step counters)
    assert abs(sharding["1"]["bytes_per_param"] - 16.0) < 1e-3
    assert abs(sharding["2"]["vs_world_1"] - 0.5) < 0.01


def test_gpu_bench_script_runs_on_cpu_with_smoke(tmp_path: Path):
    out = tmp_path / "gpu.json"
    python(
        REPO / "bench" / "gpu_bench.py",
        ["--smoke", "--configs", "eager:none:plain,eager:full:chunked", "--json", str(out)],
        timeout=600,
    )
    report = json.loads(out.read_text())
    assert [r["config"] for r in report["results"]] == ["eager:none:plain", "eager:full:chunked"]
    assert all(r["tokens_per_s"] > 0 and "error" not in r for r in report["results"])
