"""End to end on 2 gloo ranks (the recipe forked as torchrun starts it; `accelerate launch` itself is tested by
tests/recipes/test_sft_recipe.py and test_launch_mapping.py, and costs ~15 s of imports more): metrics.jsonl and TensorBoard events written and
readable, eval every 2 steps and at the end equal to a single-process evaluation of the exported fp32
weights, samples, profiler traces per rank, the run summary, and `hf-fsdp2 plot` on the run."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from support.launch import SFT, python, torchrun
from support.tiny import make_tiny_llama_dir, write_chat_jsonl

from hf_fsdp2.observe.logs import read_metrics

STEPS = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    pytest.importorskip("tensorboard")
    pytest.importorskip("matplotlib")
    root = tmp_path_factory.mktemp("observe")
    model = make_tiny_llama_dir(root / "model", seed=4)
    data = write_chat_jsonl(root / "chat.jsonl", 32, seed=9)
    eval_data = write_chat_jsonl(root / "eval.jsonl", 7, seed=3)  # 7: uneven over 2 ranks and batches of 2
    recipe = root / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model_name_or_path": str(model),
                "dataset_name": str(data),
                "output_dir": str(root / "run"),
                "max_steps": STEPS,
                "per_device_train_batch_size": 2,
                "gradient_accumulation_steps": 2,
                "learning_rate": 1e-3,
                "max_length": 64,
                "logging_steps": 1,
                "gradient_checkpointing": True,
                # fp32 throughout, so that the exported weights are exactly the ones evaluated at the end
                "mixed_precision": "no",
                "export_dtype": "float32",
                # The export is evaluated against the run's own eval loss below; its reload check is tested where it
                # is the subject (tests/unit/test_export*.py, tests/distributed/test_verify_matrix.py).
                "export_verify": False,
                "eval_dataset_name": str(eval_data),
                "eval_dataset_split": "train",
                "eval_steps": 2,
                "per_device_eval_batch_size": 2,
                "eval_prompts": ["alpha bravo", "red green"],
                "eval_max_new_tokens": 4,
                "report_to": "tensorboard",
                "profile_steps": "2-3",
            }
        )
    )
    proc = torchrun(SFT, ["--config", str(recipe)], nproc=2)
    return root / "run", eval_data, proc.stdout + proc.stderr


def test_metrics_jsonl_has_every_field(run):
    out, _, log = run
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        for key in (
            "loss",
            "lr",
            "grad_norm",
            "target_tokens",
            "target_tokens_per_s",
            "step_time_s",
            "epoch",
            "padding_efficiency",
            "tokens",
            "tokens_per_s",
            "tokens_per_s_per_device",
            "target_tokens_per_s_per_device",
            "tflops_per_device",
            "data_wait_s",
            "host_rss_gib",
            "host_peak_rss_gib",
            "eta_s",
        ):
            assert key in r, key
        assert "mfu" not in r  # CPU: achieved FLOP/s only
        assert r["tokens_per_s_per_device"] == pytest.approx(r["tokens_per_s"] / 2)
        assert r["target_tokens"] < r["tokens"]  # prompts are not targets...
        # ...and padding-free batches (this model's default) process real tokens only: positions == tokens.
        assert r["tokens"] == pytest.approx(r["target_tokens"] / r["padding_efficiency"], rel=1e-6)
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["step_time_s"], rel=1e-6)
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4]
    assert "batches: padding-free" in log
    assert "FLOPs per token 6N + 12LHQT" in log and "collective timeout ddp_timeout=1800s" in log
    assert "eval at step 2" in log and "summary: export in" in log
    assert "FSDP units: 2 x LlamaDecoderLayer" in log


def test_tensorboard_events_match_the_jsonl(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _, _ = run
    rows = read_metrics(out / "metrics.jsonl")
    events = EventAccumulator(str(out / "tensorboard" / out.name))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"loss", "lr", "tokens_per_s", "eval_loss", "eval_perplexity"} <= set(tags)
    loss = {e.step: e.value for e in events.Scalars("loss")}
    assert loss == pytest.approx({r["step"]: r["loss"] for r in rows}, rel=1e-6)
    assert {e.step for e in events.Scalars("eval_loss")} == {2, 4}
    assert any(tag.startswith("sample_0") for tag in events.Tags()["tensors"])  # the samples, as text


def test_eval_loss_equals_single_process_evaluation_of_the_export(run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_fsdp2.config.sources import resolve_sources
    from hf_fsdp2.data.mixture import build_sft_datasets

    out, eval_file, _ = run
    final = read_metrics(out / "metrics.jsonl")[-1]
    tokenizer = AutoTokenizer.from_pretrained(out)
    examples = build_sft_datasets(
        resolve_sources(dataset_name=str(eval_file)), tokenizer, max_length=64, seed=0
    ).train
    assert len(examples) == 7
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for example in examples:  # one example at a time: no padding, no FSDP
            logits = model(torch.tensor([example["input_ids"]])).logits[0, :-1].double()
            labels = torch.tensor(example["labels"][1:])
            total += float(F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum"))
            count += int((labels != -100).sum())
    assert final["eval_tokens"] == count
    assert final["eval_loss"] == pytest.approx(total / count, rel=1e-5)
    assert final["eval_perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)


def test_samples_profiler_traces_and_summary(run):
    out, _, _ = run
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [(s["step"], s["prompt"]) for s in samples] == [
        (2, "alpha bravo"),
        (2, "red green"),
        (4, "alpha bravo"),
        (4, "red green"),
    ]
    for rank in (0, 1):
        traces = list((out / "profile").glob(f"rank{rank}.*.pt.trace.json"))
        assert len(traces) == 1, rank
        names = {e.get("name") for e in json.loads(traces[0].read_text())["traceEvents"]}
        assert {"ProfilerStep#2", "ProfilerStep#3"} <= names
    rows = read_metrics(out / "metrics.jsonl")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["world_size"] == 2
    assert summary["tokens"] == sum(r["tokens"] for r in rows)
    assert summary["target_tokens"] == sum(r["target_tokens"] for r in rows)
    assert summary["final_loss"] == rows[-1]["loss"] and summary["final_eval_loss"] == rows[-1]["eval_loss"]
    assert summary["export_dir"] == str(out) and summary["mfu"] is None and summary["peak_memory_gib"] > 0
    assert summary["tokens_per_s"] > 0 and summary["wall_time_s"] > summary["train_time_s"] > 0


def test_plot_command_on_the_run(run):
    out, _, _ = run
    proc = python("-m", ["hf_fsdp2.cli", "plot", str(out)], timeout=300)
    plots = json.loads(proc.stdout.strip().splitlines()[-1])["plots"]
    assert sorted(Path(p).name for p in plots) == ["loss.png", "lr.png", "memory.png", "throughput.png"]
    assert all(Path(p).stat().st_size > 1000 for p in plots)


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_missing_tracker_is_a_clear_error(tmp_path: Path):
    proc = python(
        SFT,
        [
            "--model_name_or_path",
            "m",
            "--dataset_name",
            "d.jsonl",
            "--output_dir",
            str(tmp_path / "run"),
            "--report_to",
            "tensorboard,wandb",
        ],
        check=False,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "pip install wandb" in proc.stderr
    assert not (tmp_path / "run").exists()
