"""bench/memory_plan_gpu.py runs end to end (``--smoke``: tiny shape on CPU, the GPU script's code path), and on
CPU its measured items equal the plan's, as tests/distributed/test_memory_plan.py holds them at world 1/2/4."""

from __future__ import annotations

import json
from pathlib import Path

from support.launch import REPO, python

MODES = ("none", "full", "every_k", "selective", "offload")


def test_memory_plan_gpu_smoke_predicts_what_the_run_holds(tmp_path: Path):
    out = tmp_path / "plan_vs_measured.json"
    proc = python(REPO / "bench" / "memory_plan_gpu.py", ["--smoke", "--out", str(out)], timeout=600)
    assert "activation_checkpointing=offload" in proc.stdout and "ratio" in proc.stdout
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["shape"]["layers"] == 2
    assert set(report["modes"]) == set(MODES)
    for mode, entry in report["modes"].items():
        predicted, measured = entry["predicted"], entry["measured"]
        assert measured["chunk_tokens"] == 1024, mode  # the run took the planned loss path
        for item in ("params", "grads", "optimizer", "activations", "loss_logits"):
            assert measured[item] == predicted[item], (mode, item)
            assert entry["ratio"][item] == 1.0
        assert measured["peak"] is None and measured["forward_allocated"] is None  # no allocator on CPU
        assert predicted["peak"] == sum(v for k, v in predicted.items() if k != "peak")
    # Each mode's model is freed before the next builds its own (else later peaks include earlier models).
    alive = {mode: entry["measured"]["previous_model_alive"] for mode, entry in report["modes"].items()}
    assert alive == dict.fromkeys(MODES, False), alive
    acts = {mode: report["modes"][mode]["measured"]["activations"] for mode in MODES}
    assert acts["offload"] < acts["full"] < acts["selective"] < acts["every_k"] < acts["none"]
