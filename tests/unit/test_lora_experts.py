"""LoRA on fused MoE experts in one process (hf_fsdp2/lora/experts.py): the all-experts alias, the refusals by name,
and the gather-free merge of a rank's experts equal to PEFT's own merge_and_unload.

The 2-rank runs (parity with one-process PEFT, the adapter reloaded with plain PEFT, the merged export) are rows of
tests/distributed/test_families.py (Qwen3-MoE, Mixtral, gpt-oss, DeepSeek-V3).
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from hf_fsdp2.config import ConfigError
from hf_fsdp2.config.peft import PeftArgs
from hf_fsdp2.config.plans import LoraSettings
from hf_fsdp2.lora.adapter import LoraError, apply_lora
from hf_fsdp2.lora.experts import expert_targets, local_expert_delta
from hf_fsdp2.lora.merge import check_mergeable, merged_local_weights

_COMMON = dict(
    vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)  # fmt: skip
# Distinct sizes (hidden 64, expert width 24) so that a transposed or swapped delta could not pass unnoticed.
MOE = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24)),
    "olmoe": ("OlmoeConfig", dict(num_experts=4, num_experts_per_tok=2, intermediate_size=24)),
    "gpt_oss": ("GptOssConfig", dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=24)),
}  # fmt: skip


def _model(family: str) -> torch.nn.Module:
    cls, extra = MOE.get(family, ("LlamaConfig", {"intermediate_size": 128}))
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**_COMMON, **extra))


def _adapted(family: str, **kw) -> torch.nn.Module:
    settings = LoraSettings(r=4, alpha=8, dropout=0.0, target_parameters=["all-experts"], **kw)
    model = apply_lora(_model(family), settings, seed=0)
    with torch.no_grad():  # B starts at zero: give every pair a delta, as training would
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return model


@pytest.mark.parametrize("family", list(MOE))
def test_all_experts_names_every_fused_expert_weight(family: str) -> None:
    assert expert_targets(_model(family)) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]


def test_all_experts_on_a_model_without_fused_experts_is_refused_by_name() -> None:
    with pytest.raises(
        LoraError, match=r"all-experts: LlamaForCausalLM has no fused MoE experts .* not a mixture"
    ):
        apply_lora(_model("llama"), LoraSettings(dropout=0.0, target_parameters=["all-experts"]))
    with pytest.raises(
        LoraError,
        match=r"\[.experts.w1.\] matches no parameter of Qwen3MoeForCausalLM; its fused expert weights are",
    ):
        apply_lora(_model("qwen3_moe"), LoraSettings(dropout=0.0, target_parameters=["experts.w1"]))


def test_config_refuses_what_lora_on_parameters_cannot_do() -> None:
    base = dict(use_peft=True, lora_target_parameters=["all-experts"])
    with pytest.raises(ConfigError, match=r"lora_dropout=0.05: LoRA on a parameter .* set lora_dropout: 0"):
        PeftArgs(**base).validate()
    with pytest.raises(ConfigError, match=r"use_dora=true: PEFT has no DoRA for LoRA on parameters"):
        PeftArgs(**base, lora_dropout=0.0, use_dora=True).validate()
    with pytest.raises(ConfigError, match=r"needs use_peft=true"):
        PeftArgs(lora_target_parameters=["all-experts"], lora_dropout=0.0).validate()
    # The experts alone: no module targets.
    args = PeftArgs(**base, lora_dropout=0.0, lora_target_modules=[])
    args.validate()
    assert args.lora_settings().target_parameters == ["all-experts"]


def test_all_linear_with_dropout_on_a_moe_names_the_experts_and_the_fix() -> None:
    """PEFT's all-linear adapts Qwen3-MoE's fused experts and router as parameters, which take no dropout; before,
    the run stopped on PEFT's bare 'lora.ParamWrapper does not work with lora_dropout != 0.'."""
    with pytest.raises(LoraError) as err:
        apply_lora(_model("qwen3_moe"), LoraSettings(dropout=0.05))
    text = str(err.value)
    assert (
        "lora_dropout=0.05" in text and "mlp.experts.gate_up_proj" in text and "set lora_dropout: 0" in text
    )


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_merge_of_the_experts_equals_peft_merge_and_unload(family: str) -> None:
    """The gather-free merge (each expert's W + s B_e @ A_e; the router as a linear) equals PEFT's merge, bit for
    bit, and its model the LoRA model's logits; gpt-oss's experts are transposed and their biases stay as they
    are. Before, the merge was refused ('only LoRA on nn.Linear is merged here, not on Qwen3MoeExperts')."""
    model = _adapted(family, target_modules=["q_proj"])
    check_mergeable(model)
    merged = merged_local_weights(model)
    reference = copy.deepcopy(model).merge_and_unload()
    want = reference.state_dict()
    assert set(merged) == set(want)
    adapted = [k for k in merged if ".experts." in k and not k.endswith("_bias")]
    assert len(adapted) == 4
    base = dict(_model(family).named_parameters())
    for name, tensor in merged.items():
        assert torch.equal(tensor, want[name]), name
    for name in adapted:  # the experts moved
        assert not torch.equal(merged[name], base[name]), name
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        live, got = model(input_ids=ids).logits, reference(input_ids=ids).logits
    assert float((live - got).abs().max()) <= 1e-5


def test_a_ranks_experts_get_their_own_delta() -> None:
    """The delta of experts 2..3 alone (a rank holding the second half under FSDP2 or expert parallel) is that
    slice of the whole delta."""
    model = _adapted("qwen3_moe")
    layer = model.base_model.model.model.layers[0].mlp.experts
    a, b = layer.lora_A["default"].weight.detach(), layer.lora_B["default"].weight.detach()
    whole = local_expert_delta(layer, "default", a, b, 0, 4, torch.float32)
    assert whole.shape == layer.get_param().shape
    assert torch.equal(local_expert_delta(layer, "default", a, b, 2, 2, torch.float32), whole[2:4])
    assert torch.allclose(whole.to(layer.get_param().dtype), layer.get_delta_weight("default"), atol=1e-7)
