"""Compile plans, regional compile in place, and the compile-time / recompile watch."""

from __future__ import annotations

import re

import pytest
import torch
from support.numerics import assert_same_maths
from transformers import LlamaConfig, LlamaForCausalLM

from hf_fsdp2.compat import release
from hf_fsdp2.config.plans import ACPlan, CompilePlan
from hf_fsdp2.parallel.activations import apply_activation_checkpointing
from hf_fsdp2.parallel.compiling import (
    FLOAT64_COMPILE_MIN_TORCH,
    CompileWatch,
    check_compilable,
    compile_model,
    compile_regions,
)


def test_plan_validation_and_kwargs():
    with pytest.raises(ValueError, match="torch_compile_scope='layers' is not one of regional, model"):
        CompilePlan(enabled=True, scope="layers")
    assert CompilePlan(enabled=True).kwargs() == {"backend": "inductor", "fullgraph": False}
    assert CompilePlan(enabled=True, mode="max-autotune", dynamic=False).kwargs()["mode"] == "max-autotune"
    assert CompileWatch(enabled=False).start().take() == {}


@pytest.mark.skipif(
    release(torch.__version__)[:2] < FLOAT64_COMPILE_MIN_TORCH,
    reason="float64 compile is refused on this torch (test_float64_compile_is_refused_where_inductor_fails_it)",
)
def test_regional_compile_is_in_place_one_graph_and_counts_a_recompile():
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    # float64: inductor fuses and reorders the sums; only the float64 rounding bound is CPU-independent.
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).double()
    model.config.use_cache = False
    torch.manual_seed(0)
    reference = LlamaForCausalLM(config).double()
    reference.config.use_cache = False
    apply_activation_checkpointing(model, ACPlan("selective"), ("LlamaDecoderLayer",))
    layers_before = list(model.model.layers)
    names = compile_regions(model, ("LlamaDecoderLayer",), CompilePlan(enabled=True, dynamic=False))
    assert names == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert list(model.model.layers) == layers_before  # the same modules: hooks added later still fire
    torch._dynamo.reset()
    watch = CompileWatch(enabled=True).start()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    first = watch.take()
    assert first["compile_s"] > 0 and first["recompiles"] == 0
    graphs = first["compiled_graphs"]
    # The logits (transformers' own loss upcasts to fp32). Llama's RMSNorm and rotary tables compute in
    # fp32 whatever the model dtype, and inductor fuses them differently from eager: fp32 rounding over
    # the longest of those reductions, the 32-wide hidden state and the 64-wide MLP.
    assert_same_maths(
        out.logits, reference(input_ids=ids).logits, terms=64, rounding=torch.float32, name="logits"
    )
    model(input_ids=ids, labels=ids).loss.backward()  # same shape: no compile
    again = watch.take()
    assert again["compile_s"] == 0 and again["compiled_graphs"] == graphs
    longer = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    model(input_ids=longer, labels=longer).loss.backward()  # new shape with dynamic=False: a recompile
    after = watch.take()
    assert after["recompiles"] >= 1 and after["compile_s"] > 0


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.12.1", "2.13.0", "2.14.1"])
def test_float64_compile_is_refused_where_inductor_fails_it(version: str) -> None:
    """Below torch 2.13 a float64 model under inductor is refused at once (it would fail at the first backward);
    float32/bfloat16 models, aot_eager and eager runs are never refused; 2.13 and later compile float64."""
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    f64 = LlamaForCausalLM(config).double()
    old = release(version)[:2] < FLOAT64_COMPILE_MIN_TORCH
    plan = CompilePlan(enabled=True)
    if old:
        with pytest.raises(
            ValueError, match=rf"float64 weights fails in torch {re.escape(version)}.*torch >= 2\.13"
        ):
            check_compilable(f64, plan, version)
    else:
        check_compilable(f64, plan, version)
    check_compilable(LlamaForCausalLM(config), plan, version)  # float32
    check_compilable(LlamaForCausalLM(config).bfloat16(), plan, version)
    check_compilable(f64, CompilePlan(enabled=False), version)


def test_both_scopes_check_before_compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    """compile_regions and compile_model call the check first (this torch's version stands for an old one)."""
    from hf_fsdp2.parallel import compiling

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    monkeypatch.setattr(compiling, "FLOAT64_COMPILE_MIN_TORCH", (99, 0))
    for scope in (
        lambda m: compile_regions(m, ("LlamaDecoderLayer",), CompilePlan(enabled=True)),
        lambda m: compile_model(m, CompilePlan(enabled=True, scope="model")),
    ):
        with pytest.raises(ValueError, match="float64 weights"):
            scope(LlamaForCausalLM(config).double())
