"""Activation checkpointing modes: the same gradients, the memory each keeps, and bad settings."""

from __future__ import annotations

import pytest
import torch
from support.numerics import assert_same_maths
from transformers import LlamaConfig, LlamaForCausalLM

from hf_fsdp2.config.plans import AC_MODES, ACPlan
from hf_fsdp2.parallel.activations import activation_bytes, apply_activation_checkpointing

LAYER = ("LlamaDecoderLayer",)


def _model(seed: int = 0, dropout: float = 0.0, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_dropout=dropout,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.config.use_cache = False
    return model.to(dtype)


# Gradient comparisons run in float64: a recomputed forward may take other kernels, and only the float64
# rounding bound (support/numerics.py) is the same on every CPU.
F64 = torch.float64


def _grads(model: torch.nn.Module, ids: torch.Tensor, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


IDS = torch.randint(0, 512, (2, 96), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("mode", ["full", "every_k", "selective", "offload"])
def test_every_mode_gives_the_plain_gradients_and_keeps_names(mode):
    ref_model = _model(dtype=F64)
    reference = _grads(ref_model, IDS)
    model = _model(dtype=F64)
    wrapped = apply_activation_checkpointing(model, ACPlan(mode, every_k=2, pin_memory=False), LAYER)
    assert wrapped == (
        ["model.layers.0", "model.layers.2"] if mode == "every_k" else [f"model.layers.{i}" for i in range(4)]
    )
    assert list(model.state_dict()) == list(ref_model.state_dict())  # no wrapper prefix anywhere
    grads = _grads(model, IDS)
    for name, g in reference.items():
        assert_same_maths(grads[name], g, terms=512, name=name)


def test_recompute_replays_dropout_masks():
    """With dropout (LoRA's, attention's) the recomputed forward must draw the same masks."""
    reference = _grads(_model(dropout=0.5, dtype=F64), IDS, seed=7)
    model = _model(dropout=0.5, dtype=F64)
    apply_activation_checkpointing(model, ACPlan("full"), LAYER)
    grads = _grads(model, IDS, seed=7)
    for name, g in reference.items():
        assert_same_maths(grads[name], g, terms=512, name=name)


def test_activation_bytes_order_the_modes():
    kept = {}
    for mode in ("none", "full", "every_k", "selective"):
        model = _model()
        apply_activation_checkpointing(model, ACPlan(mode, every_k=2), LAYER)
        kept[mode] = activation_bytes(model, lambda m=model: m(input_ids=IDS, labels=IDS).loss)
    assert kept["full"] < kept["every_k"] < kept["none"]
    assert kept["full"] < kept["selective"] < kept["none"]
    # deterministic: the same number twice
    model = _model()
    assert activation_bytes(model, lambda: model(input_ids=IDS, labels=IDS).loss) == kept["none"]


def test_layer_inputs_are_what_full_checkpointing_keeps():
    model = _model()
    apply_activation_checkpointing(model, ACPlan("full"), LAYER)
    kept = activation_bytes(model, lambda: model(input_ids=IDS).logits.float().sum())
    hidden = IDS.numel() * 64 * 4  # fp32 [batch, seq, hidden]
    # one input per layer, plus what the embedding, final norm and head keep: a few hidden-sized tensors
    # and the [tokens x vocab] logits
    assert 4 * hidden <= kept <= 4 * hidden + 6 * hidden + 2 * IDS.numel() * 512 * 4


def test_bad_plans_are_refused():
    with pytest.raises(ValueError, match="activation_checkpointing='most'.*none, full"):
        ACPlan("most")
    with pytest.raises(ValueError, match="ac_every_k=0"):
        ACPlan("every_k", every_k=0)
    assert set(AC_MODES) == {"none", "full", "every_k", "selective", "offload"}
    model = _model()
    with pytest.raises(ValueError, match="found no decoder layer of classes \\['GPT2Block'\\]"):
        apply_activation_checkpointing(model, ACPlan("full"), ("GPT2Block",))
    apply_activation_checkpointing(model, ACPlan("full"), LAYER)
    with pytest.raises(ValueError, match="already activation-checkpointed"):
        apply_activation_checkpointing(model, ACPlan("full"), LAYER)


def test_every_k_selects_multiples_of_k():
    plan = ACPlan("every_k", every_k=3)
    assert [i for i in range(8) if plan.wraps(i)] == [0, 3, 6]
    assert not ACPlan("none").wraps(0) and ACPlan("selective").wraps(5)


def test_offload_moves_only_the_layer_inputs_eager_and_compiled(monkeypatch):
    """``offload`` sends each checkpointed layer's input to host memory and nothing else, also under regional
    compile: there the checkpoint is part of the layer's graph, which saves the layer's parameters (and rotary
    tables, RNG state) for its recompute through the same hooks; plain ``save_on_cpu`` copied all of them (every
    layer's gathered weights, per micro-batch). A counting hook stands in for ``save_on_cpu``'s copy."""
    from hf_fsdp2.config.plans import CompilePlan
    from hf_fsdp2.parallel.compiling import compile_regions

    moved: list[torch.Tensor] = []

    class CountingSaveOnCpu(torch.autograd.graph.saved_tensors_hooks):
        def __init__(self, pin_memory: bool = False, device_type: str = "cuda") -> None:
            super().__init__(lambda t: moved.append(t) or t, lambda t: t)

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", CountingSaveOnCpu)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    counted = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        model.config.use_cache = False
        apply_activation_checkpointing(model, ACPlan("offload", pin_memory=False), LAYER)
        if compiled:
            torch._dynamo.reset()
            compile_regions(model, LAYER, CompilePlan(enabled=True, dynamic=False))
        inputs: list[torch.Tensor] = []
        for layer in model.model.layers:
            layer.register_forward_pre_hook(lambda m, args, seen=inputs: seen.append(args[0]))
        moved.clear()
        model(input_ids=ids, labels=ids).loss.backward()
        params = {p.untyped_storage()._cdata for p in model.parameters()}
        assert not [t.shape for t in moved if t.untyped_storage()._cdata in params], "parameters sent to host"
        layer_inputs = {t.untyped_storage()._cdata for t in inputs}
        assert all(t.untyped_storage()._cdata in layer_inputs for t in moved)
        counted[compiled] = sum(t.numel() * t.element_size() for t in moved)
        assert (
            counted[compiled] == sum(t.numel() * t.element_size() for t in inputs) == 2 * ids.numel() * 32 * 4
        )
    assert counted[True] == counted[False]
