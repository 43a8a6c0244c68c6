"""The benchmark scripts run end to end at a tiny size (their figures come from full-size runs; see
bench/README.md). What must hold at any size is checked: the same work, and what each switch changes.

A bench whose driver starts its runs itself (trainer_bench, memory_bench, gpu_bench_parallel, grpo_bench) runs its
driver in this process, and each command line it builds is run by :func:`served`: the same script, arguments and
ranks, forked from the launch server instead of a fresh interpreter (~7 CPU s of imports per process; the launcher
is not what these tests check). gpu_bench's TRL runner is launched by the real ``accelerate launch``: that is checked."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import IO, Any

import torch
from support.launch import REPO, python, torchrun

from hf_fsdp2.observe.flops import FlopsModel
from hf_fsdp2.observe.meter import StepMeter


def load_bench(name: str) -> ModuleType:
    """A bench script imported as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass looks its module up there (trainer_bench's RecipePieces)
    spec.loader.exec_module(module)
    return module


def _served_env_differences(env: dict[str, str]) -> list[str]:
    """What a bench puts in its child's environment that a served process would not see. PYTHONPATH is left out: a
    served process imports from the checkout and tests/ (the launch server's path). HF_HUB_OFFLINE,
    TOKENIZERS_PARALLELISM and OMP_NUM_THREADS are set for served runs as the benches set them; CUDA_VISIBLE_DEVICES=""
    (a --cpu run) changes nothing where torch sees no GPU."""
    served = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    served.setdefault("OMP_NUM_THREADS", "1")
    if not torch.cuda.is_available():
        served["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "")
    return [
        f"{k}={v!r} (served: {served.get(k)!r})"
        for k, v in env.items()
        if k != "PYTHONPATH" and served.get(k) != v
    ]


def served(
    cmd: list[str],
    *,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    stdout: IO[str] | int | None = None,
    **_: Any,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, ...)`` for a bench's child command, ``python script args`` or ``python -m
    torch.distributed.run [flags] script args``: the script runs on the same ranks with the same arguments, forked
    from this worker's launch server (support.launch); ``stdout`` a file: the output goes there, as the bench asked."""
    assert cmd[0] == sys.executable, (
        f"a bench launched {cmd[0]}, not this interpreter ({sys.executable}): {cmd}"
    )
    differences = _served_env_differences(env or {})
    assert not differences, (
        f"the bench's child environment differs from a served run's: {differences}; cmd {cmd}"
    )
    limit = int(timeout or 900)
    if cmd[1:3] == ["-m", "torch.distributed.run"]:
        from torch.distributed.run import get_args_parser

        launch = get_args_parser().parse_args(cmd[3:])  # torchrun's own reading of its flags
        assert not launch.module and not launch.no_python, cmd
        done = torchrun(
            launch.training_script,
            launch.training_script_args,
            nproc=int(launch.nproc_per_node),
            timeout=limit,
            check=False,
        )
    else:
        assert Path(cmd[1]).suffix == ".py", f"served runs a script file, not {cmd[1:]}"
        done = python(cmd[1], cmd[2:], timeout=limit, check=False)
    if stdout is not None and not isinstance(stdout, int):
        stdout.write(done.stdout + done.stderr)
    return done


def test_trainer_bench_runs_the_same_work_in_every_runner(tmp_path: Path):
    out = tmp_path / "tb.json"
    load_bench("trainer_bench").main(
        [
            "--rounds",
            "1",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--hidden",
            "64",
            "--layers",
            "2",
            "--batch-size",
            "8",
            "--max-length",
            "256",
            "--work",
            str(tmp_path / "work"),
            "--json",
            str(out),
        ],
        run=served,
    )
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
    load_bench("memory_bench").main(
        [
            "--hidden",
            "64",
            "--intermediate",
            "128",
            "--layers",
            "4",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--vocab",
            "4096",
            "--seq",
            "1024",
            "--batch",
            "2",
            "--repeats",
            "1",
            "--worlds",
            "1,2",
            "--work",
            str(tmp_path / "work"),
            "--json",
            str(out),
        ],
        run=served,
    )
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
        [
            "--smoke",
            "--configs",
            "eager:none:plain,eager:full:chunked",
            "--work",
            str(tmp_path / "work"),
            "--out",
            str(out),
        ],
        timeout=600,
    )
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
        meter = StepMeter(
            flops=fm,
            world_size=1,
            device=torch.device("cpu"),
            total_steps=1,
            peak_flops=None,
            pad_token_id=None,
        )
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


def test_gpu_bench_parallel_charges_the_long_sequence_as_the_recipe_meter(monkeypatch):
    """cp x tp ranks each count their data rank's whole row; the meter divides by cp x tp: the bench's FLOPs per
    device are what the recipe's meter reports for the same ranks (8 ranks: cp 4 x tp 2, and dp 2 x cp 2 x tp 2)."""
    from hf_fsdp2.observe import meter as meter_module

    bench = load_bench("gpu_bench_parallel")
    fm = bench.flops_model("8b")
    assert fm.layers == 32 and fm.heads == 32 and fm.head_dim == 128
    seq = 131072
    for cp, tp in ((4, 2), (2, 2)):
        m = StepMeter(
            flops=fm,
            world_size=8,
            device=torch.device("cpu"),
            total_steps=1,
            peak_flops=None,
            pad_token_id=None,
        )
        m.start_step()
        m.count([{"input_ids": torch.zeros(1, seq, dtype=torch.long)}])  # this rank's data rank's whole row
        m.end_step(target_tokens=seq - 1, sync=False)
        monkeypatch.setattr(
            meter_module.collectives,
            "gather_rows",
            lambda values, device=None: torch.tensor([list(values)] * 8, dtype=torch.float64),
        )
        monkeypatch.setattr(meter_module.collectives, "cp_size", lambda cp=cp: cp)
        monkeypatch.setattr(meter_module.collectives, "tp_size", lambda tp=tp: tp)
        m.collect(step=1, loss_sum=torch.tensor(0.0))
        got = bench.per_device_flops(fm, seq, nproc=8, cp=cp, tp=tp)
        assert math.isclose(got, m.totals["flops"] / 8, rel_tol=1e-12), (cp, tp)
        # The attention of the whole 128k row is most of it, charged at T = seq, never at the part a rank holds.
        attention = 12 * fm.layers * fm.heads * fm.head_dim * seq * seq
        assert attention / fm.for_sequences([seq]) > 0.8
        assert math.isclose(got, fm.for_sequences([seq]) * (8 // (cp * tp)) / 8, rel_tol=1e-12)


def test_gpu_bench_parallel_smoke_trains_the_cp1_losses_under_cp2(tmp_path: Path):
    """--smoke: cp 2 (all-to-all) on 2 gloo processes, the library's mesh, CP, FSDP2 and step; a cp-1 run of the
    same shape, rows and init gives the same losses (fp32); --dry-run plans 8k-128k on 8B without running."""
    bench = load_bench("gpu_bench_parallel")
    bench.main(["--smoke", "--out", str(tmp_path / "cp2.json")], run=served)
    bench.main(
        [
            "--cpu",
            "--shape",
            "tiny",
            "--seq",
            "256",
            "--warmup",
            "1",
            "--steps",
            "1",
            "--out",
            str(tmp_path / "cp1.json"),
        ],
        run=served,
    )
    (cp2,) = json.loads((tmp_path / "cp2.json").read_text())["results"]
    (cp1,) = json.loads((tmp_path / "cp1.json").read_text())["results"]
    assert "error" not in cp2 and "error" not in cp1, (cp2.get("traceback"), cp1.get("traceback"))
    assert cp2["cp"].startswith("context parallel: all-to-all over 2 ranks") and "cp" not in cp1
    assert len(cp2["losses"]) == 2 and all(math.isfinite(x) for x in cp2["losses"])
    # The counted step's collectives, printed next to the seconds: the all-to-alls only under cp 2 (2 decoder layers:
    # q, k, v gathered and the output scattered, in the forward, again in full checkpointing's recompute, and back).
    assert (
        cp2["collectives_per_step"]["all_to_all"] == 2 * 3 * 4
        and "all_to_all" not in cp1["collectives_per_step"]
    )
    for a, b in zip(cp2["losses"], cp1["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (cp2["losses"], cp1["losses"])
    assert cp2["tokens_per_s"] > 0 and math.isclose(
        cp2["tflops_per_device"], cp2["tflop_per_device_per_step"] / cp2["step_s"], rel_tol=1e-9
    )
    plan = tmp_path / "plan.json"
    bench.main(
        [
            "--dry-run",
            "--shape",
            "8b",
            "--cp",
            "8",
            "--cp-backend",
            "ring",
            "--seq",
            "8192,32768,131072",
            "--out",
            str(plan),
        ],
        run=served,
    )
    rows = json.loads(plan.read_text())["results"]
    assert [r["seq"] for r in rows] == [8192, 32768, 131072] and all("tokens_per_s" not in r for r in rows)
    assert all("--nproc_per_node 8 " in r["launch"] and "--cp-backend ring" in r["launch"] for r in rows)
    # Per device, 128k costs more than 16x 8k: the attention grows with the square of the row.
    assert rows[2]["tflop_per_device_per_step"] > 16 * rows[0]["tflop_per_device_per_step"]


def test_gpu_bench_fp8_flag_runs_a_bf16_and_an_fp8_twin(tmp_path: Path):
    """``--fp8``: each hf_fsdp2 runner and its mixed_precision fp8 twin on the same rows (CPU: torchao's emulation
    over fp32; on a GPU without FP8 tensor cores the twin is listed as skipped with the reason)."""
    out = tmp_path / "gpu.json"
    python(
        REPO / "bench" / "gpu_bench.py",
        [
            "--smoke",
            "--configs",
            "eager:none:chunked",
            "--fp8",
            "--trl",
            "",
            "--work",
            str(tmp_path / "work"),
            "--out",
            str(out),
        ],
        timeout=600,
    )
    runs = {r["config"]: r for r in json.loads(out.read_text())["results"]}
    assert list(runs) == ["eager:none:chunked", "eager:none:chunked:fp8"]
    bf16, fp8 = runs["eager:none:chunked"], runs["eager:none:chunked:fp8"]
    assert (bf16["precision"], fp8["precision"]) == ("bf16", "fp8")
    for r in (bf16, fp8):
        assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0 and r["timed_tokens"] == 256
    # the same init and rows: the first step's loss (before any update) differs by the float8 rounding
    assert fp8["losses"][0] != bf16["losses"][0] and all(math.isfinite(x) for x in fp8["losses"])
    # the GPU check's FP8 comparison on this CPU run: the warm-up step's FP8 loss within the run-time bound of the
    # same forward without float8 casts at the same weights (hf_fsdp2/parallel/float8_bound.py); the reference is
    # the bf16 runner's maths (fp32 here), so its loss is the bf16 runner's first one
    from gpu.tolerances import fp8_probe_figures

    figures = fp8_probe_figures(fp8["fp8_probes"])
    probe = fp8["fp8_probes"][0]
    assert len(fp8["fp8_probes"]) == 1 and probe["step"] == 0 and probe["fp8_loss"] == fp8["losses"][0]
    assert abs(probe["ref_loss"] - bf16["losses"][0]) < 1e-5
    assert figures["fp8_probe_max_ratio"] <= 1.0, fp8["fp8_probes"]
    # far sharper than the first-order worst case, and the rounding is visible in it
    assert figures["fp8_bound"][0] < figures["fp8_worst_case"][0] / 20 and figures["fp8_loss_diff"][0] > 0


def test_moe_bench_kernels_run_every_experts_implementation_to_the_same_output(tmp_path: Path):
    out = tmp_path / "kernels.json"
    bench = load_bench("moe_bench")
    args = ["kernels", "--hidden", "64", "--inter", "32", "--experts", "4", "--top-k", "2", "--tokens", "64"]
    bench.main([*args, "--repeats", "1", "--json", str(out)])
    rows = {r["implementation"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"eager (per-expert loop)", "grouped_mm", "grouped_mm fallback (loop)"}
    assert all(r["ms"] > 0 and r["max_diff"] < 1e-5 for r in rows.values()), rows
    assert rows["grouped_mm"]["vs_grouped_mm"] == 1.0
