"""The peak-FLOP table: every entry found from the name torch.cuda.get_device_name() reports, whole tokens
only, the most specific name first; unknown devices have no peak (the ``peak_flops`` key then gives it)."""

from __future__ import annotations

import pytest

from hf_fsdp2.observe.flops import PEAK_FLOPS, peak_flops_for

# (device name as torch reports it, table entry it must get, peak dense bf16 FLOP/s of that device)
DEVICES = [
    ("NVIDIA H100 80GB HBM3", "H100", 989e12),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756e12),
    ("NVIDIA H100 NVL", "H100 NVL", 835e12),
    ("NVIDIA H200", "H200", 989e12),
    ("NVIDIA H200 NVL", "H200 NVL", 835e12),
    ("NVIDIA GH200 480GB", "GH200", 989e12),
    ("NVIDIA H20", "H20", 148e12),
    ("NVIDIA B200", "B200", 2.25e15),
    ("NVIDIA A100-SXM4-80GB", "A100", 312e12),
    ("NVIDIA A100-SXM4-40GB", "A100", 312e12),
    ("NVIDIA A100 80GB PCIe", "A100", 312e12),
    ("NVIDIA A800-SXM4-80GB", "A800", 312e12),
    ("NVIDIA A10G", "A10G", 70e12),
    ("NVIDIA A10", "A10", 125e12),
    ("NVIDIA L40S", "L40S", 362e12),
    ("NVIDIA L40", "L40", 181e12),
    ("NVIDIA L4", "L4", 121e12),
    ("NVIDIA GeForce RTX 4090", "RTX 4090", 165e12),
    ("AMD Instinct MI300X", "MI300X", 1307e12),
    ("AMD Instinct MI325X", "MI325X", 1307e12),
    # ROCm reports one device per GCD, two per MI250X package
    ("AMD Instinct MI250X", "MI250X", 191.5e12),
    ("AMD Instinct MI250X/MI250", "MI250X", 191.5e12),
]


@pytest.mark.parametrize(("device", "entry", "peak"), DEVICES, ids=[d[0] for d in DEVICES])
def test_each_device_gets_its_own_entry(device: str, entry: str, peak: float) -> None:
    assert PEAK_FLOPS[entry] == peak
    assert peak_flops_for(device) == peak


def test_every_entry_is_tested_with_a_real_device_name() -> None:
    assert {entry for _, entry, _ in DEVICES} == set(PEAK_FLOPS)


def test_names_match_whole_tokens_only() -> None:
    # A shorter name inside a longer token is not a match: L4 in L40, H20 in H200, A10 in A100, H200 in GH200.
    assert peak_flops_for("NVIDIA L40") != PEAK_FLOPS["L4"]
    assert peak_flops_for("NVIDIA H200") != PEAK_FLOPS["H20"]
    assert peak_flops_for("NVIDIA A100-SXM4-80GB") != PEAK_FLOPS["A10"]
    # Variants of a listed device that the table does not know fall back to nothing rather than a neighbour.
    assert peak_flops_for("NVIDIA L40G") is None
    assert peak_flops_for("NVIDIA A40") is None


@pytest.mark.parametrize(
    "device", ["cpu", "Intel Xeon", "NVIDIA GeForce RTX 3090", "Tesla V100-SXM2-16GB", ""]
)
def test_unknown_devices_have_no_peak(device: str) -> None:
    assert peak_flops_for(device) is None


def test_a_mixture_of_experts_is_counted_at_its_active_parameters() -> None:
    """``N`` of an MoE: each layer's routed experts at top_k / experts of their parameters (what a token runs), the
    rest (attention, routers, shared experts, head) whole; a dense model: every non-embedding parameter. Qwen3-30B-A3B
    at 1 of its 48 layers on the meta device, scaled to 48: 30.5B parameters, 3.35B of them a token runs (its model
    card: 3.3B activated of 30.5B), where the meter charged all of them before."""
    import torch
    import transformers

    from hf_fsdp2.observe.flops import (
        active_non_embedding_params,
        inactive_expert_params,
        non_embedding_params,
    )

    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    experts = 128 * 3 * 2048 * 768
    assert inactive_expert_params(model) == experts * 120 // 128
    active = active_non_embedding_params(model)
    assert active == non_embedding_params(model) - experts * 120 // 128
    small, table = (
        64 * 2048,
        151936 * 2048,
    )  # this model's embedding (and untied head), and the real vocabulary's
    layer = sum(p.numel() for p in model.parameters()) - 2 * small - 2048
    active_layer = active - small - 2048
    assert round((2 * table + 2048 + 48 * layer) / 1e9, 1) == 30.5
    assert round((2 * table + 2048 + 48 * active_layer) / 1e9, 2) == 3.35
    with torch.device("meta"):
        dense = transformers.AutoModelForCausalLM.from_config(
            transformers.LlamaConfig(
                hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
            )
        )
    assert inactive_expert_params(dense) == 0
