"""Every choice that changes which collectives run is the same on every rank, whatever each rank's data.

Each case runs the recipe on 2 gloo ranks with an untied output head (its own FSDP unit, so a loss path
that differs between ranks reorders the collectives) and data that differs per rank: very uneven
lengths around ``ce_chunk_tokens``, eval sets that do not split evenly, examples without any target
token, a last partial batch, LoRA, padding-free batches and packed rows. A broken case deadlocks: the
short ``ddp_timeout`` and ``host_wait_timeout`` (device collectives, host-group waits) turn that into a failure
within a minute instead of a hung suite.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml
from support.launch import SFT, torchrun
from support.tiny import WORDS, make_tiny_llama_dir

from hf_fsdp2.observe.logs import read_metrics


def _records(n: int, seed: int, longest: int = 60) -> list[dict]:
    """Prompt/completion records of very uneven lengths (1 to ``longest`` words), and some whose completion
    is cut away by max_length=48 (no target token at all)."""
    rng = random.Random(seed)
    out: list[dict] = []
    for i in range(n):
        if i % 7 == 3:  # a long prompt and a short completion: max_length cuts the completion away
            out.append({"prompt": " ".join(rng.choices(WORDS, k=60)), "completion": " end"})
        else:
            words = 1 if i % 2 else rng.randint(longest // 2, longest)
            out.append({"prompt": "Say:", "completion": " " + " ".join(rng.choices(WORDS, k=words))})
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("symmetry")
    model = make_tiny_llama_dir(root / "model", tie_word_embeddings=False, seed=4)
    train, evals = root / "train.jsonl", root / "eval.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in _records(45, 1)))  # 45: a last partial batch
    evals.write_text("".join(json.dumps(r) + "\n" for r in _records(5, 2)))  # 5 over 2 ranks
    # The everyday run: default max_length and ce_chunk_tokens (1024), per-device batch 8, 64 records of
    # mixed lengths; a rank's padded batch is then over 1024 tokens or far under it, step by step.
    (root / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records(64, 3, longest=250)))
    return model, train, evals


CASES = {
    "uneven_chunk_eval_epochs": {"per_device_train_batch_size": 1, "ce_chunk_tokens": 40,
                                 "gradient_accumulation_steps": 2, "num_train_epochs": 2, "eval_steps": 10,
                                 "eval_prompts": ["Say:"], "eval_max_new_tokens": 3},
    "default_settings_batch_8": {"per_device_train_batch_size": 8, "num_train_epochs": 1, "max_length": 1024,
                                 "dataset_name": "mixed.jsonl"},
    "lora": {"per_device_train_batch_size": 1, "ce_chunk_tokens": 40, "use_peft": True, "max_steps": 8,
             "learning_rate": 1e-2},
    "padding_free": {"per_device_train_batch_size": 3, "ce_chunk_tokens": 40, "padding_free": True, "max_steps": 8},
    "packing": {"per_device_train_batch_size": 1, "ce_chunk_tokens": 40, "packing": True, "max_steps": 8},
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_ranks_with_different_data_never_deadlock(setup, tmp_path: Path, case: str) -> None:
    model, train, evals = setup
    out = tmp_path / "run"
    recipe = {
        "model_name_or_path": str(model),
        "dataset_name": str(train),
        "eval_dataset_name": str(evals),
        "output_dir": str(out),
        "max_length": 48,
        "logging_steps": 1,
        "learning_rate": 1e-3,
        "mixed_precision": "no",
        "ddp_timeout": 60,
        "host_wait_timeout": 60,
        "export_verify": False,
        **CASES[case],
    }
    recipe["dataset_name"] = str(train.parent / Path(recipe["dataset_name"]).name)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    proc = torchrun(SFT, ["--config", str(tmp_path / "recipe.yaml")], nproc=2, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_metrics(out / "metrics.jsonl")
    assert rows and all(r["loss"] == r["loss"] for r in rows)  # every step logged, no NaN
    log = proc.stdout + proc.stderr
    if recipe["max_length"] == 48:  # examples with zero targets were trained on
        assert "without any target token (kept, no loss)" in log
    assert "loss: chunked cross entropy" in log  # one loss path for the run, whatever the batch
    if case == "uneven_chunk_eval_epochs":
        assert rows[-1]["epoch"] == 1  # the second epoch ran, through the last partial batch
        assert [r["step"] for r in rows if "eval_loss" in r] == [10, 20, rows[-1]["step"]]
