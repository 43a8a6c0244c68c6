"""hf-fsdp2 eval-harness on SmolLM2-135M-Instruct, end to end on CPU: lm-eval's exact match (greedy
generate_until) and accuracy (argmax of summed log-likelihoods) equal a direct computation with transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from support.harness import direct_scores, harness_answers

from hf_fsdp2.harness.evaluate import evaluate_and_report
from hf_fsdp2.harness.tasks import DATES_MC_TASK, DATES_TASK

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow
N = 4


def test_smollm2_harness_numbers_equal_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_fsdp2.demo.assets import ensure_smollm2

    cached = ensure_smollm2()
    model_dir = tmp_path / "smollm2"  # the card is written into the folder: a copy, the weights linked
    model_dir.mkdir()
    for f in cached.iterdir():
        (model_dir / f.name).symlink_to(f) if f.suffix == ".safetensors" else shutil.copy(
            f, model_dir / f.name
        )
    (model_dir / "README.md").write_text("# SmolLM2\n")
    report = evaluate_and_report(
        model_dir, [DATES_TASK, DATES_MC_TASK], local_items=N, log_samples=True, device="cpu", batch_size=4
    )
    model = AutoModelForCausalLM.from_pretrained(cached, dtype=torch.float32)
    direct = direct_scores(model, AutoTokenizer.from_pretrained(cached), N)
    assert harness_answers(report.after["samples"][DATES_TASK]) == direct["answers"]
    assert report.after["tasks"][DATES_TASK]["exact_match"] == direct["exact_match"]
    assert report.after["tasks"][DATES_MC_TASK]["acc"] == direct["acc"]
    assert report.after["settings"]["apply_chat_template"] is True  # SmolLM2 has a chat template
    assert (
        json.loads((model_dir / "eval_harness.json").read_text())["after"]["tasks"] == report.after["tasks"]
    )
    assert f"| {DATES_TASK} | exact_match |" in (model_dir / "README.md").read_text()


def test_a_2_rank_lora_run_scores_its_adapter_and_a_checkpoint_is_exported_on_the_fly(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """``eval_harness_tasks`` on a LoRA run's export (the adapter over its base), then ``hf-fsdp2 eval-harness`` on
    its checkpoint (the adapter exported on the fly): the same weights, the same log-likelihoods, the same score."""
    from support.runs import sft_2ranks, shared_assets, write_recipe

    from hf_fsdp2.cli import main

    model, data = shared_assets(tmp_path_factory)
    out = tmp_path / "run"
    lora = {"use_peft": True, "lora_r": 4, "lora_alpha": 8, "learning_rate": 1e-2, "save_steps": 1}
    recipe = write_recipe(
        tmp_path / "r.yaml",
        model,
        data,
        out,
        max_steps=1,
        eval_harness_tasks=DATES_MC_TASK,
        eval_harness_limit=2,
        **lora,
    )
    done = sft_2ranks(recipe)
    saved = json.loads((out / "eval_harness.json").read_text())["after"]
    assert saved["tasks"][DATES_MC_TASK]["n"] == 2 and saved["model"] == str(out)
    assert saved["adapter"] == str(out) and saved["base_model"] == str(model)  # the adapter over its base
    assert f"| {DATES_MC_TASK} | acc |" in (out / "README.md").read_text()  # the card of the export
    assert f"hf-fsdp2 eval-harness {out} --tasks {DATES_MC_TASK} --limit 2" in done.stderr
    assert main(["eval-harness", str(out / "checkpoint-1"), "--tasks", DATES_MC_TASK, "--limit", "2"]) == 0
    again = json.loads((out / "eval_harness-checkpoint-1.json").read_text())["after"]
    assert again["kind"] == "checkpoint" and again["base_model"] == str(model)
    assert again["tasks"] == saved["tasks"]
    assert not [p.name for p in out.iterdir() if p.name.startswith(".eval-harness-export")]
