"""Expert parallel through the SFT recipe on 2 gloo ranks (``ep_size: 2``: each rank holds 2 of Qwen3-MoE's 4 experts
per layer, tokens exchanged): the run reads the key, splits the experts from rank 0's weights, trains LoRA on the fused
experts with the router loss on, in bf16 mixed precision, activation checkpointing, packed rows and 2 micro-batches per
step, logs the experts' load, and exports an adapter and a merged model that its own
verification reloads (plain PEFT, plain transformers) to the run's logits; the merged model reloads with plain
transformers outside the run too. The parity of every layout with a one-process loop: test_expert_parallel.py and
test_lora_experts_ep.py (the library's step); this is the recipe's path (config -> session -> build -> finish)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from support.families import make_family_dir
from support.runs import sft_2ranks, write_recipe
from support.tiny import write_chat_jsonl
from transformers import AutoModelForCausalLM

from hf_fsdp2.observe.logs import read_metrics


def test_sft_with_ep_size_trains_lora_on_the_experts_and_exports_verified(tmp_path: Path) -> None:
    model = make_family_dir(tmp_path / "moe", "qwen3_moe", overrides={"output_router_logits": True})
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 16, seed=3)
    recipe = write_recipe(
        tmp_path / "r.yaml",
        model,
        data,
        tmp_path / "run",
        max_steps=3,
        ep_size=2,
        use_peft=True,
        lora_r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        lora_target_parameters=["all-experts"],
        merge_adapter=True,
        export_verify=True,
        save_steps=0,
        # bf16 mixed precision (the experts' fp32 masters on their own mesh), the layers recomputed in the backward
        # (the exchanges again), two micro-batches per step.
        mixed_precision="bf16",
        activation_checkpointing="full",
        gradient_accumulation_steps=2,
        packing=True,  # several documents per row (position_ids restart): the experts see tokens, not rows
    )
    proc = sft_2ranks(recipe)
    log = proc.stdout + proc.stderr
    assert "expert parallel 2: 2 experts modules (Qwen3MoeExperts)" in log, log[-3000:]
    assert "activation checkpointing full on 2 decoder layers" in log, log[-3000:]
    assert "examples packed (best-fit decreasing)" in log, log[-3000:]
    assert "adapter verified" in log and "verified" in log.split("adapter verified", 1)[1], log[-3000:]
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 3, rows
    for row in rows:
        assert math.isfinite(row["loss"]) and math.isfinite(row["aux_loss"]), row
        assert 0 <= row["moe_load_min"] <= 1 <= row["moe_load_max"], row
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "merged", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    moved = [
        n
        for n, p in merged.named_parameters()
        if ".experts." in n and not torch.equal(p, base.get_parameter(n))
    ]
    assert moved, "the merged experts equal the base: the adapter on the experts did not merge"
