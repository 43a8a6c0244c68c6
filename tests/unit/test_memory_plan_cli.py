"""``hf-fsdp2 plan`` and the start-of-run plan (hf_fsdp2/plan/, hf_fsdp2/commands/plan.py,
docs/memory-plan.md).

The command on a local tiny Llama folder: the table's rows and figures, recipe overrides, the recommendation
(a cheaper setting when the budget is small, "does not fit" with the reason when nothing fits), and the errors
users can act on (a size that is not one, a MoE config, a hub id offline, a config that is not a causal LM).
Every dense family of tests/support/families.py plans from its config alone; LoRA on the meta model is the
adapter the run trains. ``log_run_plan`` never fails a run, restores the RNG and warns when a GPU is too small.
The exactness against real runs is tests/distributed/test_memory_plan.py.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
import yaml
from support.families import _COMMON, FAMILIES
from support.launch import REPO, python
from support.tiny import make_tiny_llama_dir

from hf_fsdp2 import cli
from hf_fsdp2.config import parse_config
from hf_fsdp2.config.plans import ACPlan, LoraSettings
from hf_fsdp2.methods import get_method, parse_method_config
from hf_fsdp2.plan import (
    DEFAULT_HEADROOM,
    PlanError,
    PlanSettings,
    build_meta_model,
    format_plan,
    human_bytes,
    log_run_plan,
    memory_warning,
    plan_memory,
    state_bytes,
)

MOE = (
    "qwen3_moe",
    "mixtral",
    "gpt_oss",
    "qwen3_5_moe",
    "qwen3_next",
    "glm4_moe",
    "deepseek_v3",
    "granite4",
    "llama4_text",
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama_dir(tmp_path_factory.mktemp("plan") / "llama", seed=3)


def _recipe(tmp: Path, model: Path | str, **overrides: object) -> Path:
    values: dict[str, object] = {
        "model_name_or_path": str(model),
        "dataset_name": "data.jsonl",  # never read by the plan
        "output_dir": str(tmp / "run"),
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "max_length": 128,
        "mixed_precision": "bf16",
    }
    values.update(overrides)
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _family_config(name: str) -> transformers.PretrainedConfig:
    kind, extra = FAMILIES[name]
    ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # inside the small vocabulary
    return getattr(transformers, kind)(**{**_COMMON, "vocab_size": 1000, **ids, **extra})


def test_table_has_every_item_and_the_plans_figures(model_dir, tmp_path, capsys):
    recipe = _recipe(tmp_path, model_dir, gradient_checkpointing=True)
    code, out, _ = _plan(capsys, "--config", str(recipe), "--world_size", "2", "--device", "cpu")
    assert code == 0
    cfg = parse_config(["--config", str(recipe)])
    settings = PlanSettings.from_config(cfg, world_size=2, device_type="cpu")
    plan = plan_memory(transformers.AutoConfig.from_pretrained(model_dir), settings)
    items = plan.rank_total(plan.worst_rank)
    assert out.splitlines()[0].startswith("memory plan: LlamaForCausalLM")
    assert "world 2, micro-batch 4 x 128 tokens, mixed_precision=bf16, activation_checkpointing=full" in out
    rows = {
        "parameters (sharded)": "params",
        "gradients (sharded)": "grads",
        "optimizer state (AdamW)": "optimizer",
        "FSDP buffers": "fsdp_buffers",
        "activations kept for backward": "activations",
        "loss and logits kept for backward": "loss_logits",
        "transient (largest working set)": "transient",
        "peak": "peak",
    }
    lines = {line[:36].strip(): line[36:48].strip() for line in out.splitlines()[2:]}
    for label, key in rows.items():
        assert lines[label] == human_bytes(items[key]), label
    assert items["peak"] == sum(items[k] for k in rows.values() if k != "peak")
    # fp32 masters sharded over 2 ranks: half of 4 bytes per parameter (dim 0 splits evenly here), AdamW twice that.
    # fp32 masters sharded over 2 ranks (every dim 0 splits evenly here); AdamW: two moments and a step each.
    tensors = len(list(build_meta_model(plan_config(model_dir), settings).parameters()))
    assert items["params"] == items["grads"] == plan.total_params * 4 // 2
    assert items["optimizer"] == 2 * items["params"] + 4 * tensors
    assert "recommended" not in out and "fit" not in out  # no budget and no GPU: no recommendation


def plan_config(model_dir: Path) -> transformers.PretrainedConfig:
    return transformers.AutoConfig.from_pretrained(model_dir)


def test_recipe_overrides_and_json(model_dir, tmp_path, capsys):
    # Padded rows: activations linear in tokens (a padding-free layout's dense mask is T^2: tested below).
    recipe = _recipe(tmp_path, model_dir, padding_free=False)
    argv = ["--config", str(recipe), "--device", "cpu", "--json"]
    _, short, _ = _plan(capsys, *argv)
    code, long, _ = _plan(capsys, *argv, "--max_length", "256", "--world_size", "4")
    assert code == 0
    short_plan, long_plan = json.loads(short), json.loads(long)
    assert long_plan["settings"]["max_length"] == 256 and long_plan["settings"]["world_size"] == 4
    assert len(long_plan["ranks"]) == 4
    assert (
        long_plan["ranks"][0]["activations"] == 2 * short_plan["ranks"][0]["activations"]
    )  # linear in tokens
    assert long_plan["ranks"][0]["params"] < short_plan["ranks"][0]["params"]  # 4 shards instead of 1


def test_small_budget_recommends_more_checkpointing_and_big_one_none(model_dir, tmp_path, capsys):
    recipe = _recipe(tmp_path, model_dir, gradient_checkpointing=True)
    base = ["--config", str(recipe), "--world_size", "2", "--device", "cpu"]
    code, out, _ = _plan(capsys, *base, "--gpu_memory", "64GiB")
    assert code == 0
    # Checkpointing costs recompute: with room to spare the cheapest setting is none, not the recipe's full.
    assert "recommended: --activation_checkpointing none" in out
    _, raw, _ = _plan(capsys, *base, "--gpu_memory", "64GiB", "--json")
    none = json.loads(raw)["recommendation"][0]
    full = json.loads(raw)["peak"]  # the recipe's own plan: full checkpointing
    assert none["changes"] == {"activation_checkpointing": "none"} and none["peak"] > full
    budget = (none["peak"] + full) // 2  # no headroom: fits full, not none
    code, out, _ = _plan(capsys, *base, "--gpu_memory", str(budget), "--headroom", "0")
    assert code == 0
    tried = [line for line in out.splitlines() if line.startswith("  ")]
    assert tried[0].startswith("  no ") and tried[-1].startswith("  fits")
    last = out.splitlines()[-1]
    assert last.startswith("recommended:") and "activation_checkpointing none" not in last


def test_nothing_fits_says_why(model_dir, tmp_path, capsys):
    recipe = _recipe(tmp_path, model_dir)
    code, out, _ = _plan(capsys, "--config", str(recipe), "--device", "cpu", "--gpu_memory", "1MB")
    assert code == 0
    last = out.splitlines()[-1]
    assert last.startswith("does not fit:") and f"> {human_bytes(900_000)}" in last  # 1e6 bytes less 10%
    assert "sharded state alone" in last and "--world_size" in last and "max_length" in last
    # Every rung was tried down to micro-batch 1 (CPU: no offload rungs).
    assert "per_device_train_batch_size=1, gradient_accumulation_steps=8" in out


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--gpu_memory", "eighty"], ["--gpu_memory 'eighty'", "80GB"]),
        (["--gpu_memory", "80GB", "--headroom", "1.5"], ["--headroom 1.5", "[0, 1)"]),
        (["--world_size", "0"], ["--world_size 0", ">= 1"]),
        (["--world_size", "3", "--dp_shard_size", "2"], ["dp_shard_size", "3"]),
        (["--model_config", "/nonexistent/config.json"], ["/nonexistent/config.json", "config.json"]),
        (["--activation_checkpointing", "sometimes"], ["activation_checkpointing", "sometimes"]),
    ],
)
def test_bad_inputs_name_value_and_fix(model_dir, tmp_path, capsys, argv, needles):
    recipe = _recipe(tmp_path, model_dir)
    code, out, err = _plan(capsys, "--config", str(recipe), "--device", "cpu", *argv)
    assert code == 2 and out == ""
    assert err.startswith("hf-fsdp2 plan: error: ") and len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err, (needle, err)


def test_moe_configs_plan_and_experts_that_are_not_fused_are_refused(tmp_path, capsys):
    """transformers' fused experts run tokens x top_k rows whatever the routing, so the meta forward plans them
    (tests/unit/test_plan_experts.py checks the bytes against a real forward); DeepSeek-V3 (a dense first layer, shared
    experts) and Granite 4 (a Mamba-2 layer, MoE beside a shared MLP) here. Llama 4's experts are not fused that way:
    refused with the reason. Before, every MoE config was refused."""
    for name in ("deepseek_v3", "granite4"):
        folder = tmp_path / name
        _family_config(name).save_pretrained(folder)  # config.json only: no weights needed
        code, out, err = _plan(capsys, "--config", str(_recipe(tmp_path, folder)), "--device", "cpu")
        assert code == 0, err
        assert re.search(r"^MoE: [12] layers of \w+Experts, 4 experts \(top 2\)", out, re.MULTILINE), out
    folder = tmp_path / "llama4_text"
    _family_config("llama4_text").save_pretrained(folder)
    code, _, err = _plan(capsys, "--config", str(_recipe(tmp_path, folder)), "--device", "cpu")
    assert code == 2
    assert (
        "mixture of experts (num_local_experts=4) whose experts are not transformers' fused experts" in err
    ), err
    assert "measure a short run" in err
    t5 = tmp_path / "t5"
    transformers.T5Config(d_model=32, num_layers=1, num_heads=2, d_ff=64, vocab_size=100).save_pretrained(t5)
    code, _, err = _plan(capsys, "--config", str(_recipe(tmp_path, t5)), "--device", "cpu")
    assert code == 2 and "cannot build T5Config on the meta device" in err
    # Model code that refuses its config (a pad token outside the vocabulary): the reason, not a traceback.
    phi3 = tmp_path / "phi3"
    transformers.Phi3Config(**{**_COMMON, "vocab_size": 1000, "pad_token_id": 32000}).save_pretrained(phi3)
    code, _, err = _plan(capsys, "--config", str(_recipe(tmp_path, phi3)), "--device", "cpu")
    assert (
        code == 2 and "cannot build Phi3Config" in err and "Padding_idx must be within num_embeddings" in err
    )


@pytest.mark.parametrize("name", [n for n in FAMILIES if n not in MOE])
def test_every_dense_family_plans_from_its_config(name):
    config = _family_config(name)
    settings = PlanSettings(
        world_size=2, micro_batch=2, seq_len=32, ac=ACPlan("full", 2, pin_memory=False), device_type="cpu"
    )
    plan = plan_memory(config, settings)
    items = plan.rank_total(0)
    assert items["params"] > 0 and items["activations"] > 0 and items["loss_logits"] > 0
    assert plan.peak == max(plan.rank_total(r)["peak"] for r in range(2))


def test_meta_lora_is_the_adapter_the_run_trains(model_dir):
    from hf_fsdp2.lora.adapter import apply_lora
    from hf_fsdp2.model import load_model

    lora = LoraSettings(
        r=4, alpha=8, dropout=0.0, target_modules=["all-linear"], modules_to_save=None, use_rslora=False
    )
    settings = PlanSettings(world_size=2, lora=lora, mixed_precision="bf16", load_dtype="bfloat16")
    meta = build_meta_model(plan_config(model_dir), settings)
    real = apply_lora(load_model(str(model_dir), dtype="bfloat16"), lora, seed=0)

    def layout(model: torch.nn.Module) -> dict[str, tuple]:
        return {n: (tuple(p.shape), p.dtype, p.requires_grad) for n, p in model.named_parameters()}

    assert layout(meta) == layout(real)
    frozen = state_bytes(meta, settings, 0)
    assert frozen["optimizer"] == sum(
        2 * p.numel() * 4 // 2 + 4 for p in meta.parameters() if p.requires_grad
    )


def test_4bit_base_and_dora_are_planned_and_an_uneven_split_is_refused(model_dir, tmp_path, capsys):
    """QLoRA / QDoRA plans: the decoder linears in NF4 (the run's own quantisation on the meta model), so each
    rank holds about a quarter of their bf16 bytes; the table and JSON say so. Exact bytes against real runs:
    tests/distributed/test_memory_plan.py."""
    pytest.importorskip("torchao")
    recipe = _recipe(tmp_path, model_dir, use_peft=True, torch_dtype="bfloat16")
    argv = ["--config", str(recipe), "--device", "cpu", "--world_size", "2"]
    code, out, _ = _plan(capsys, *argv, "--load_in_4bit", "true", "--use_dora", "true")
    assert code == 0, out
    assert "QDoRA (NF4 base) r=16" in out and "decoder linears in NF4 (4-bit, each rank 1/2)" in out
    plans = {
        flag: json.loads(_plan(capsys, *argv, "--json", "--load_in_4bit", flag)[1])
        for flag in ("false", "true")
    }
    lora, qlora = plans["false"], plans["true"]
    assert qlora["settings"]["load_in_4bit"] and not lora["settings"]["load_in_4bit"]
    assert qlora["trainable_params"] == lora["trainable_params"]  # the same adapter
    config = plan_config(model_dir)
    linear = sum(
        m.weight.numel()
        for m in build_meta_model(config, PlanSettings(load_dtype="bfloat16")).model.layers.modules()
        if isinstance(m, torch.nn.Linear)
    )
    saved = lora["ranks"][0]["params"] - qlora["ranks"][0]["params"]
    # bf16 (2 bytes) -> NF4 (~0.52 bytes: codes, 8-bit scales, their factors, a table per weight), over 2 ranks.
    assert 0.7 * linear < saved < 0.75 * linear, (saved, linear)
    # The all-gathers move the 4-bit parts, not bf16 weights: every decoder layer's unit is smaller.
    layer_units = [
        (a["gathered_bytes"], b["gathered_bytes"])
        for a, b in zip(lora["units"], qlora["units"], strict=True)
        if ".layers." in a["name"]
    ]
    assert layer_units and all(q < 0.5 * b for b, q in layer_units)
    code, _, err = _plan(
        capsys, "--config", str(recipe), "--device", "cpu", "--world_size", "3", "--load_in_4bit", "true"
    )
    assert code != 0 and "cannot be split evenly into NF4 shards over 3 ranks" in err, err


def test_the_plans_lora_config_is_the_runs(model_dir):
    """One builder (hf_fsdp2/lora/build.py) for the run and the plan: the ``LoraConfig`` PEFT holds on the meta
    model equals the real run's, field by field, settings that leave the parameter layout alone included
    (dropout, rsLoRA: the layout test above cannot see them)."""
    from hf_fsdp2.lora.adapter import apply_lora
    from hf_fsdp2.lora.build import lora_config
    from hf_fsdp2.model import load_model

    lora = LoraSettings(
        r=4,
        alpha=8,
        dropout=0.05,
        target_modules=["q_proj", "v_proj"],
        modules_to_save=["lm_head"],
        use_rslora=True,
    )
    meta = build_meta_model(plan_config(model_dir), PlanSettings(lora=lora, load_dtype="bfloat16"))
    real = apply_lora(load_model(str(model_dir), dtype="bfloat16"), lora, seed=0)
    planned, trained = meta.peft_config["default"].to_dict(), real.peft_config["default"].to_dict()
    assert planned == trained, {
        k: (planned[k], trained.get(k)) for k in planned if planned[k] != trained.get(k)
    }
    built = lora_config(lora).to_dict()
    for key in ("r", "lora_alpha", "lora_dropout", "use_rslora", "bias", "task_type"):
        assert planned[key] == built[key], key


def test_hub_id_offline_names_the_fix_and_model_config_plans_a_shipped_recipe(model_dir):
    """The console script on the shipped Llama-3-8B recipe: offline its hub id cannot be read (the error names
    --model_config); given a config.json it plans without any weight."""
    recipe = REPO / "recipes" / "configs" / "llama3_8b_sft.yaml"
    # `python -m hf_fsdp2.cli`, forked from the launch server (support.launch: HF_HUB_OFFLINE=1 as every launch)
    cmd = ["hf_fsdp2.cli", "plan", "--config", str(recipe), "--world_size", "8"]
    failed = python("-m", cmd, check=False)
    assert failed.returncode == 2
    assert "meta-llama/Llama-3.1-8B-Instruct" in failed.stderr and "--model_config" in failed.stderr
    done = python(
        "-m", [*cmd, "--model_config", str(model_dir / "config.json"), "--gpu_memory", "80GB"], check=False
    )
    assert done.returncode == 0, done.stderr
    assert "world 8, micro-batch 2 x 4096 tokens" in done.stdout and "recommended:" in done.stdout


def test_start_of_run_plan_never_fails_and_restores_the_rng(model_dir, tmp_path, caplog, monkeypatch):
    cfg = parse_config(["--config", str(_recipe(tmp_path, model_dir))])
    caplog.set_level(logging.INFO, logger="hf_fsdp2")
    state = torch.get_rng_state()
    plan = log_run_plan(cfg, plan_config(model_dir), world_size=2, device=torch.device("cpu"))
    assert plan is not None and torch.equal(state, torch.get_rng_state())
    assert "memory plan: LlamaForCausalLM" in caplog.text and "exceeds" not in caplog.text
    # A model the planner refuses: one warning line, no exception.
    caplog.clear()
    assert log_run_plan(cfg, _family_config("llama4_text"), world_size=2, device=torch.device("cpu")) is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "memory plan unavailable (the run goes on)" in warnings[0].getMessage()
    assert "mixture of experts" in warnings[0].getMessage()
    # A GPU smaller than the peak: the warning names both and the command that finds settings that fit.
    caplog.clear()
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=2**20)
    )
    assert log_run_plan(cfg, plan_config(model_dir), world_size=2, device=torch.device("cuda", 0)) is not None
    warning = next(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "exceeds 90% of this GPU's 1.0 MiB" in warning and "hf-fsdp2 plan --config" in warning


def test_plan_errors_are_plan_errors():
    with pytest.raises(PlanError, match="world_size=0 must be >= 1"):
        PlanSettings(world_size=0)
    with pytest.raises(PlanError, match="fsdp_cpu_offload=true needs a GPU run"):
        PlanSettings(device_type="cpu", cpu_offload=True)


def test_the_plan_counts_the_dense_mask_of_padding_free_sdpa_on_a_gpu(model_dir):
    config = plan_config(model_dir)
    base = PlanSettings(micro_batch=2, seq_len=64, device_type="cuda", ac=ACPlan("none"))
    padded = plan_memory(config, base.replace(padding_free=False))
    dense = plan_memory(config, base.replace(padding_free=True))  # asked for, with sdpa (transformers' pick)
    flex = plan_memory(config, base.replace(padding_free=True, attn_implementation="flex_attention"))
    assert not padded.layout.padding_free and dense.layout.dense_mask and not flex.layout.dense_mask
    tokens = 2 * 64  # one row of the whole micro-batch
    # sdpa turns transformers' bool [1, 1, T, T] mask into a bf16 bias per layer, which the memory-efficient
    # kernel (the only one that takes a mask) keeps for backward.
    bias = config.num_hidden_layers * tokens * tokens * 2
    extra = dense.compute.saved.activations - padded.compute.saved.activations
    assert extra >= bias, (extra, bias)
    assert dense.peak - padded.peak >= bias
    assert abs(flex.compute.saved.activations - padded.compute.saved.activations) < bias // 4  # no mask kept
    # T^2: twice the tokens, four times the bias.
    longer = plan_memory(config, base.replace(padding_free=True, seq_len=128))
    longer_padded = plan_memory(config, base.replace(padding_free=False, seq_len=128))
    assert longer.compute.saved.activations - longer_padded.compute.saved.activations >= 4 * bias


def test_the_plan_takes_the_layout_the_run_takes(model_dir, tmp_path):
    cfg = parse_config(["--config", str(_recipe(tmp_path, model_dir))])  # padding_free unset
    plans = {
        device: plan_memory(
            plan_config(model_dir), PlanSettings.from_config(cfg, world_size=1, device_type=device)
        )
        for device in ("cuda", "cpu")
    }
    assert not plans["cuda"].layout.padding_free and "padded" in format_plan(plans["cuda"]).splitlines()[0]
    assert plans["cpu"].layout.padding_free and plans["cpu"].layout.dense_mask  # the CPU probe: padding-free
    settings = plans["cuda"].to_json()["settings"]
    assert (
        settings["padding_free"] is False and settings["attention"] == "sdpa" and not settings["dense_mask"]
    )
    cpt = PlanSettings.from_config(cfg, world_size=1, device_type="cuda", method=get_method("cpt"))
    # CPT rows hold documents apart; padding_free unset, which keeps the rows under sdpa: a mask per row.
    assert cpt.packing and cpt.padding_free is None
    assert not plan_memory(plan_config(model_dir), cpt).layout.padding_free


def test_start_of_run_warning_uses_the_recommenders_headroom(model_dir, tmp_path, caplog, monkeypatch):
    import argparse

    from hf_fsdp2.commands.plan import register_plan

    parser = argparse.ArgumentParser()
    register_plan(parser.add_subparsers())
    assert parser.parse_args(["plan"]).headroom == DEFAULT_HEADROOM  # what `hf-fsdp2 plan` calls "fits"
    assert memory_warning(90, 100, 1) is None and memory_warning(91, 100, 1) is not None
    cfg = parse_config(["--config", str(_recipe(tmp_path, model_dir))])
    caplog.set_level(logging.INFO, logger="hf_fsdp2")
    settings = PlanSettings.from_config(cfg, world_size=1, device_type="cuda")
    peak = plan_memory(plan_config(model_dir), settings).peak
    for total, warns in (
        (int(peak / 0.95), True),
        (int(peak / 0.85), False),
    ):  # under 100 %, over / under 90 %
        caplog.clear()
        monkeypatch.setattr(
            torch.cuda,
            "get_device_properties",
            lambda device, total=total: SimpleNamespace(total_memory=total),
        )
        assert log_run_plan(cfg, plan_config(model_dir), world_size=1, device=torch.device("cuda", 0))
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert bool(warnings) == warns, (total, peak, warnings)
        if warns:
            assert "exceeds 90% of this GPU's" in warnings[0] and "--world_size 1" in warnings[0]


def test_the_dpo_plan_names_the_reference_it_leaves_out_and_none_for_reference_free_objectives(
    model_dir, tmp_path
):
    recipe = _recipe(tmp_path, model_dir)

    def recipe_notes(argv: list[str], name: str) -> list[str]:
        method = get_method(name)
        return method.plan_notes(parse_method_config(method, ["--config", str(recipe), *argv]), None, None)

    notes = {loss: recipe_notes(["--loss_type", loss], "dpo") for loss in ("sigmoid", "simpo", "orpo")}
    assert len(notes["sigmoid"]) == 1 and "not planned: DPO's reference model" in notes["sigmoid"][0]
    assert notes["simpo"] == notes["orpo"] == []  # the policy alone: nothing left out
    assert recipe_notes([], "sft") == []
    kto = recipe_notes([], "kto")
    assert "not planned: KTO's reference model" in kto[0] and "simpo" not in kto[0] and "KTO rows" in kto[1]
    lora = recipe_notes(["--use_peft", "true"], "kto")
    assert len(lora) == 1 and "KTO rows" in lora[0]  # the LoRA base is the reference: no second model
