"""The preference and RL methods on composite checkpoints (vision tower + projector + language model), each through its
recipe on 2 gloo ranks on text data: DPO's frozen reference and GRPO's KL reference are the composite loaded as the
policy (frozen, sharded with the tower and projector as units), GRPO generates on the composite, and a reward model
over Gemma 3's composite exports the whole checkpoint with its score head."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from support.composites import checkpoint_names, make_composite_dir
from support.launch import REPO, torchrun
from support.tiny import WORDS

from hf_fsdp2.observe.logs import read_metrics

COMMON = (
    "--mixed_precision",
    "no",
    "--logging_steps",
    "1",
    "--save_steps",
    "0",
    "--train_sampling_strategy",
    "sequential",
    "--max_length",
    "64",
)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("composite_methods")
    rng = random.Random(4)
    pairs, prompts = root / "pairs.jsonl", root / "prompts.jsonl"
    with pairs.open("w") as fh:
        for _ in range(16):
            q = " ".join(rng.choices(WORDS, k=rng.randint(2, 8)))
            a, b = (" ".join(rng.choices(WORDS, k=rng.randint(1, 8))) for _ in range(2))
            fh.write(json.dumps({"prompt": q, "chosen": " " + a, "rejected": " " + b}) + "\n")
    with prompts.open("w") as fh:
        for _ in range(16):
            fh.write(json.dumps({"prompt": " ".join(rng.choices(WORDS, k=rng.randint(2, 6)))}) + "\n")
    return {
        "gemma3": make_composite_dir(root / "gemma3", "gemma3_vlm", processor=False),
        "qwen3_5": make_composite_dir(root / "qwen3_5", "qwen3_5_vlm"),
        "pairs": pairs,
        "prompts": prompts,
    }


def _run(recipe: str, model: Path, data: Path, out: Path, *extra: str):  # type: ignore[no-untyped-def]
    args = ["--model_name_or_path", str(model), "--dataset_name", str(data), "--output_dir", str(out)]
    return torchrun(REPO / "recipes" / f"{recipe}.py", [*args, *COMMON, *extra], nproc=2)


def test_dpo_on_a_composite_starts_from_its_frozen_composite_reference(
    assets: dict[str, Path], tmp_path: Path
) -> None:
    """Qwen3.5's composite is tied at the top level only: its text class alone would have an untied random head, and
    a reference loaded so would not start at ln 2."""
    run = _run(
        "dpo",
        assets["qwen3_5"],
        assets["pairs"],
        tmp_path / "dpo",
        "--max_steps",
        "3",
        "--per_device_train_batch_size",
        "2",
        "--learning_rate",
        "1e-2",
        "--export_verify",
        "false",
    )
    text = run.stdout + run.stderr
    assert "DPO reference: " in text and "frozen, sharded" in text
    assert "FSDP units: 1 x Qwen3_5VisionModel" in text
    metrics = read_metrics(tmp_path / "dpo" / "metrics.jsonl")
    assert metrics[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert metrics[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert abs(metrics[-1]["rewards/margins"]) > 1e-4  # the policy moved, the reference did not


def test_grpo_on_a_composite_generates_on_it_against_its_frozen_reference(
    assets: dict[str, Path], tmp_path: Path
) -> None:
    run = _run(
        "grpo",
        assets["gemma3"],
        assets["prompts"],
        tmp_path / "grpo",
        "--max_steps",
        "3",
        "--per_device_train_batch_size",
        "4",
        "--num_generations",
        "4",
        "--max_completion_length",
        "6",
        "--reward_funcs",
        "format",
        "--reward_format_pattern",
        "(?s).*[aeiou].*",
        "--beta",
        "0.04",
        "--learning_rate",
        "1e-2",
        "--export_verify",
        "false",
    )
    text = run.stdout + run.stderr
    assert "eos_token_id [2, 2097]" in text  # generation_config.json's end of turn, read on every rank
    metrics = read_metrics(tmp_path / "grpo" / "metrics.jsonl")
    assert all(m["completions/mean_length"] > 0 for m in metrics)
    assert metrics[0]["kl"] == 0.0  # the reference is the policy as loaded
    assert metrics[-1]["kl"] > 0  # and stays frozen while the policy moves


def test_a_reward_model_over_a_composite_exports_the_whole_checkpoint(
    assets: dict[str, Path], tmp_path: Path
) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "rm"
    _run(
        "rm",
        assets["gemma3"],
        assets["pairs"],
        out,
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "2",
        "--learning_rate",
        "1e-2",
        "--export_dtype",
        "float32",
    )
    assert json.loads((out / ".hf_fsdp2_export.json").read_text())["verified"]
    names = checkpoint_names(out)
    source = checkpoint_names(assets["gemma3"])
    assert set(names) == set(source) | {"score.weight"}  # every tensor under its name, and the score head
    with (
        safe_open(str(assets["gemma3"] / "model.safetensors"), "pt") as src,
        safe_open(str(out / "model.safetensors"), "pt") as got,
    ):
        for key in (k for k in source if k.startswith(("vision_tower.", "multi_modal_projector."))):
            assert torch.equal(src.get_tensor(key), got.get_tensor(key)), key
    model = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32)
    assert type(model).__name__ == "Gemma3ForSequenceClassification"


def test_qlora_on_a_composite_quantises_its_language_model_and_merges_into_the_whole_checkpoint(
    assets: dict[str, Path], tmp_path: Path
) -> None:
    from safetensors import safe_open
    from support.tiny import write_chat_jsonl

    out = tmp_path / "qlora"
    run = _run(
        "sft",
        assets["gemma3"],
        write_chat_jsonl(tmp_path / "chat.jsonl", 16, seed=3),
        out,
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "2",
        "--use_peft",
        "true",
        "--load_in_4bit",
        "true",
        "--lora_r",
        "4",
        "--lora_alpha",
        "8",
        "--merge_adapter",
        "true",
        "--learning_rate",
        "1e-2",
    )
    text = run.stdout + run.stderr
    # The language model's 2 layers x 7 linears in NF4; SigLIP's encoder layers (in the composite's
    # _no_split_modules) keep their dtype.
    assert "4-bit base (NF4, double-quantised scales): 14 linear weights of the decoder layers" in text
    assert "adapter reloaded with plain PEFT on the 4-bit base" in text
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert "model\\.vision_tower" in adapter["exclude_modules"]
    merged = out / "merged"
    assert checkpoint_names(merged) == checkpoint_names(assets["gemma3"])
    with (
        safe_open(str(assets["gemma3"] / "model.safetensors"), "pt") as src,
        safe_open(str(merged / "model.safetensors"), "pt") as got,
    ):
        for key in (
            k for k in checkpoint_names(merged) if k.startswith(("vision_tower.", "multi_modal_projector."))
        ):
            assert torch.equal(src.get_tensor(key), got.get_tensor(key)), key
