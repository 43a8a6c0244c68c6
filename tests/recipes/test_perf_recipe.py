"""The recipe with selective activation checkpointing and regional compile (2 gloo ranks): compile time
and recompiles in metrics.jsonl and the summary, and the same losses as the eager, unwrapped run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from support.launch import SFT, torchrun
from support.tiny import make_tiny_llama_dir, write_chat_jsonl

from hf_fsdp2.observe.logs import read_metrics


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    root = tmp_path_factory.mktemp("perf_recipe")
    model = make_tiny_llama_dir(root / "model", seed=6)
    data = write_chat_jsonl(root / "chat.jsonl", 24, seed=2)
    out = {}
    for name, extra in {
        "eager": {},
        "selective_compiled": {"activation_checkpointing": "selective", "torch_compile": True},
    }.items():
        recipe = root / f"{name}.yaml"
        recipe.write_text(
            yaml.safe_dump(
                {
                    "model_name_or_path": str(model),
                    "dataset_name": str(data),
                    "output_dir": str(root / name),
                    "max_steps": 3,
                    "per_device_train_batch_size": 2,
                    "learning_rate": 1e-3,
                    "max_length": 64,
                    "logging_steps": 1,
                    "mixed_precision": "no",
                    "export_verify": False,
                    **extra,
                }
            )
        )
        proc = torchrun(SFT, ["--config", str(recipe)], nproc=2)
        out[name] = (root / name, proc.stdout + proc.stderr)
    return out


def test_compile_time_and_recompiles_are_reported(runs):
    out, log = runs["selective_compiled"]
    rows = read_metrics(out / "metrics.jsonl")
    assert rows[0]["compile_s"] > 0 and rows[0]["compiled_graphs"] >= 1
    assert all("recompiles" in r for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["compile_time_s"] == pytest.approx(sum(r["compile_s"] for r in rows))
    assert summary["throughput_excludes_compile"]
    assert summary["tokens_per_s"] > summary["tokens_per_s_including_compile"]  # compile time left out
    assert "activation checkpointing selective; torch.compile regional" in log
    assert "torch.compile" in log and "compiling inside the steps" in log


def test_same_losses_as_the_eager_run(runs):
    eager = [r["loss"] for r in read_metrics(runs["eager"][0] / "metrics.jsonl")]
    compiled = [r["loss"] for r in read_metrics(runs["selective_compiled"][0] / "metrics.jsonl")]
    assert compiled == pytest.approx(eager, rel=1e-5)
    assert "compile_s" not in read_metrics(runs["eager"][0] / "metrics.jsonl")[0]
