"""The benchmark scripts run end to end at a tiny size (their figures come from full-size runs; see
bench/README.md). What must hold at any size is checked: the same work, and what each switch changes."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from types import ModuleType

import torch
from support.launch import REPO, python

from hf_fsdp2.observe.flops import FlopsModel
from hf_fsdp2.observe.meter import StepMeter


def load_bench(name: str) -> ModuleType:
    """A bench script imported as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trainer_bench_runs_the_same_work_in_every_runner(tmp_path: Path):
    out = tmp_path / "tb.json"
    python(
        REPO / "bench" / "trainer_bench.py",
        ["--rounds", "1", "--steps", "3", "--warmup", "1", "--hidden", "64", "--layers", "2",
         "--batch-size", "8", "--max-length", "256", "--work", str(tmp_path / "work"), "--json", str(out)],
        timeout=900,
    )  # fmt: skip
    table = json.loads(out.read_text())["medians"]
    assert set(table) == {"hf_fsdp2", "hf_fsdp2_padded", "hf_fsdp2_plain_ce", "trainer", "trl", "matmul"}
    losses = {name: row["final_loss"] for name, row in table.items() if name != "matmul"}
    # Same model, examples, order, batches and optimizer: the same loss after the last step.
    for name, loss in losses.items():
        assert abs(loss - losses["trainer"]) < 1e-3 * losses["trainer"], (name, losses)
    assert (
        abs(table["hf_fsdp2_padded"]["padding_eff"] - table["trainer"]["padding_eff"]) < 1e-9
    )  # same padded batches
    assert (
        table["hf_fsdp2"]["padding_eff"] > 1.5 * table["trainer"]["padding_eff"]
    )  # the default: padding-free
    # The full [tokens x vocab] fp32 logits (vocab 49152) are what chunked cross entropy never builds.
    assert table["hf_fsdp2"]["peak_rss_gib"] < table["hf_fsdp2_plain_ce"]["peak_rss_gib"]
    # Useful FLOP/s against an fp32 matmul timed in the same run. The convention charges the output head at
    # every real token: runners that compute it there stay under the matmul's rate; the chunked loss computes
    # it at target positions only (this model is nearly all head), so its conventional fraction may pass 1,
    # but not 1 / padding efficiency (the work it skips is at most the non-target positions).
    assert table["matmul"]["matmul_gflops"] > 0
    for name in losses:
        bound = 1 / table[name]["padding_eff"] if name in ("hf_fsdp2", "hf_fsdp2_padded") else 1
        assert 0 < table[name]["matmul_fraction"] < bound, (name, table[name])
        assert len(table[name]["speed_vs_trainer_per_round"]) == 1


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


def test_gpu_bench_smoke_runs_hf_fsdp2_and_trl_on_the_same_rows(tmp_path: Path):
    out = tmp_path / "gpu.json"
    python(
        REPO / "bench" / "gpu_bench.py",
        ["--smoke", "--configs", "eager:none:plain,eager:full:chunked", "--work", str(tmp_path / "work"),
         "--out", str(out)],
        timeout=600,
    )  # fmt: skip
    report = json.loads(out.read_text())
    runs = {r["name"]: r for r in report["results"]}
    assert list(runs) == [
        "trl none:none",
        "trl liger:none",
        "hf_fsdp2 eager:none:plain",
        "hf_fsdp2 eager:full:chunked",
    ]
    measured = [runs["trl none:none"], runs["hf_fsdp2 eager:none:plain"], runs["hf_fsdp2 eager:full:chunked"]]
    for r in measured:
        assert "error" not in r and "skipped" not in r, r
        for key in ("tokens_per_s", "target_tokens_per_s", "step_s", "tflops", "x_trl"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["name"], key, r[key])
        # Each document's first token has no target; every runner trains the same rows (seq 256, 1 timed step).
        assert r["target_tokens_per_s"] < r["tokens_per_s"]
        assert (r["timed_tokens"], r["timed_targets"]) == (256, measured[1]["timed_targets"])
    trl, hf = runs["trl none:none"], runs["hf_fsdp2 eager:none:plain"]
    # TRL ran through accelerate launch with TRL's FSDP2 file, sharded (on gloo here), with its packing knobs.
    assert trl["fsdp2_sharded"] is True
    assert "accelerate_configs/fsdp2.yaml --num_processes 1" in trl["launch"]
    assert (
        trl["settings"]["packing"]
        and trl["settings"]["padding_free"]
        and not trl["settings"]["use_liger_kernel"]
    )
    assert report["trl_baseline"] == "trl none:none" and trl["x_trl"] == 1.0
    assert abs(hf["x_trl"] - hf["tokens_per_s"] / trl["tokens_per_s"]) < 1e-9
    # The same init, rows, order and optimizer in fp32: the same loss after the last step.
    assert abs(trl["final_loss"] - hf["final_loss"]) < 1e-5 * hf["final_loss"], (
        trl["final_loss"],
        hf["final_loss"],
    )
    # Liger needs CUDA and liger-kernel: listed with the reason, never with a number.
    liger = runs["trl liger:none"]
    assert "CUDA" in liger["skipped"] and "tokens_per_s" not in liger


def test_gpu_bench_charges_each_document_at_its_own_length_as_the_recipe_meter():
    bench = load_bench("gpu_bench_work")
    # The 1B shape: N = 1.236e9 non-embedding parameters (tied head), 16 layers, 32 heads of 64.
    fm = FlopsModel(non_embedding_params=1_235_814_400, layers=16, heads=32, head_dim=64)
    seq = 4096
    for step in range(3):
        batch = bench.packed_batch(seq, 128256, step)
        tokens, targets, flops = bench.batch_counts(batch, fm)
        # What the recipe's meter charges for the same micro-batch.
        meter = StepMeter(flops=fm, world_size=1, device=torch.device("cpu"), total_steps=1, peak_flops=None,
                          pad_token_id=None)  # fmt: skip
        meter.start_step()
        meter.count([batch])
        meter.end_step(target_tokens=targets, sync=False)
        meter.collect(step=1, loss_sum=torch.tensor(0.0))
        assert (tokens, flops) == (meter.totals["tokens"], meter.totals["flops"])
        # ... which is the documents' own lengths, counted here from the position restarts.
        starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist()
        lengths = [b - a for a, b in zip(starts, [*starts[1:], seq], strict=True)]
        assert len(lengths) > 2 and sum(lengths) == tokens == seq
        assert flops == fm.for_sequences(lengths)
        assert targets == seq - len(lengths)  # no target across a document boundary
        # Charging every token at T = seq (the old count) overstates the FLOPs by more than 10%.
        at_seq = seq * fm.per_token(seq)
        assert at_seq / flops > 1.10, at_seq / flops
