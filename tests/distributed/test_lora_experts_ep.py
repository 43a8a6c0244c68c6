"""LoRA on the fused MoE experts under expert parallel (2 gloo ranks, ``ep 2``: each rank holds half of every
layer's experts and adds the LoRA deltas of its own experts only; hf_fsdp2/lora/experts.py).

For Qwen3-MoE (PEFT's all-linear: attention, router and experts, the experts named by ``all-experts`` too) and gpt-oss
(transposed experts with frozen biases, ``all-experts``): fp32 losses of 3 steps with 2 micro-batches per rank equal
one-process PEFT + torch.optim.AdamW on every rank's micro-batches (relative 1e-4, the family matrix's reference,
tests/distributed/test_families.py), and so do the gradient norms; the adapter reloads with plain PEFT on the base to
the reference logits; the merged export (each rank merging its own experts) reloads with plain transformers to the
same logits. (The run's own export verification, a reload in a fresh process, is left off: these reloads check more,
against the reference; tests/recipes/test_expert_parallel_recipe.py runs it under expert parallel.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from support.families import make_family_dir
from support.launch import torchrun
from test_families import _close, _probe, reference
from transformers import AutoModelForCausalLM

WORKER = Path(__file__).parent / "workers" / "lora_ep_worker.py"
# family -> lora_target_parameters (beside all-linear), spelt for the plain-PEFT reference as the parameters it names.
FAMILIES = {
    "qwen3_moe": ("all-experts", ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]),
    "gpt_oss": ("all-experts", ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("lora_ep")
    # Router loss off: the adapter is what is compared (the router loss under ep has its own tests).
    for family in FAMILIES:
        make_family_dir(root / "models" / family, family, overrides={"output_router_logits": False})
    spec = ",".join(f"{family}:{alias}" for family, (alias, _) in FAMILIES.items())
    torchrun(
        WORKER,
        ["--root", str(root / "models"), "--families", spec, "--out", str(root / "out")],
        nproc=2,
        timeout=900,
    )
    return root / "models", root / "out"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_lora_on_experts_under_expert_parallel_matches_peft_and_merges(
    runs: tuple[Path, Path], family: str
) -> None:
    models, out = runs
    result = json.loads((out / family / "result.json").read_text())
    assert "error" not in result, f"{result.get('error')}\n{result.get('traceback')}"
    norms: list[float] = []
    want, ref_model = reference(models / family, lora=True, parameters=FAMILIES[family][1], norms=norms)
    print(f"{family}: max relative loss difference {_close(result['losses'], want):.2e}")
    # The gradient norms too: AdamW's normalised update hides a wrong scale of the experts' LoRA gradients from the
    # losses (without the ep compensation in lora/experts.py they were 1.3e-3 off, the losses 6e-8).
    print(f"{family}: max relative grad-norm difference {_close(result['grad_norms'], norms):.2e}")
    saved = load_file(out / family / "lora" / "adapter_model.safetensors")
    experts = [k for k in saved if ".experts." in k and "lora_B" in k]
    assert len(experts) == 4 and all(float(saved[k].abs().max()) > 0 for k in experts), sorted(saved)
    expected = _probe(ref_model)
    limit = 1e-3 * max(1.0, float(expected.abs().max()))
    base = AutoModelForCausalLM.from_pretrained(models / family, dtype=torch.float32)
    adapter = PeftModel.from_pretrained(base, out / family / "lora").eval()
    assert float((_probe(adapter) - expected).abs().max()) <= limit
    merged = AutoModelForCausalLM.from_pretrained(
        out / family / "lora" / "merged", dtype=torch.float32
    ).eval()
    assert float((_probe(merged) - expected).abs().max()) <= limit
