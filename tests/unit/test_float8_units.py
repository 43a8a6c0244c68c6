"""``mixed_precision: fp8`` without processes: the e4m3/e5m2 bounds of one emulated float8 linear (forward and both
gradients), what is converted and what stays bf16 (torchao's size thresholds at Llama-3-8B's shapes), the refusals (hardware, QLoRA, LoRA, TP, rank-0 loading,
rowwise all-gather), the export's unwrapping and the verification's float8 probe limit.

The bound of a float8 cast (derivation in tests/distributed/test_float8.py): a tensorwise-scaled cast to a format
with m mantissa bits, largest value F and half-subnormal spacing h moves each element by at most
``u |t| + amax(t) h / F`` with u = 2^-(m+1): e4m3 u = 2^-4, F = 448, h = 2^-10; e5m2 u = 2^-3, F = 57344, h = 2^-17.
A product of cast operands then differs from the exact one by at most ``e(a)|b| + |a|e(b) + e(a)e(b)``.
"""

from __future__ import annotations

import pytest
import torch

from hf_fsdp2.config import ConfigError
from hf_fsdp2.config.float8 import Float8Plan, check_float8_combination
from hf_fsdp2.config.parse import parse_config
from hf_fsdp2.config.training import FSDPArgs, TrainArgs
from hf_fsdp2.export.probe import FLOAT8_NOISE_RATIO, NOISE_MARGIN, live_float8, probe_limit
from hf_fsdp2.parallel.float8 import (
    below_float8_size,
    check_float8_hardware,
    convert_float8,
    fp8_hardware_problem,
    plan_float8,
    warn_without_compile,
    without_float8_wrapper,
)

E4M3 = (2.0**-4 + 2.0**-23, 448.0, 2.0**-10)
E5M2 = (2.0**-3 + 2.0**-23, 57344.0, 2.0**-17)


def cast_error(t: torch.Tensor, fmt: tuple[float, float, float]) -> torch.Tensor:
    u, top, half_sub = fmt
    return u * t.abs() + float(t.abs().max()) / top * half_sub


def product_error(a: torch.Tensor, fa: tuple, b: torch.Tensor, fb: tuple) -> torch.Tensor:
    """Elementwise bound of |a^ @ b^ - a @ b| for a cast to fa and b cast to fb."""
    ea, eb = cast_error(a, fa), cast_error(b, fb)
    return ea @ b.abs() + a.abs() @ eb + ea @ eb


class Block(torch.nn.Module):
    """A decoder-layer stand-in: attention-like linears, a router, a 24-wide linear and a LoRA-like adapter."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(64, 64, bias=False)
        self.up_proj = torch.nn.Linear(64, 128, bias=False)
        self.gate = torch.nn.Linear(64, 16, bias=False)  # a MoE router: stays bf16
        self.odd_proj = torch.nn.Linear(64, 24, bias=False)  # 24 is not a multiple of 16
        self.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(64, 16, bias=False)})


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 64)
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.lm_head = torch.nn.Linear(64, 10, bias=False)


def test_one_float8_linear_forward_and_gradients_within_the_e4m3_e5m2_bounds() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False))
    exact = torch.nn.Linear(64, 32, bias=False)
    exact.weight.data.copy_(model[0].weight.data)

    class Wrap(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([model])

    wrap = Wrap()
    report = convert_float8(
        wrap, ["Sequential"], Float8Plan(emulate=True, all_gather=False, size_filter=False)
    )
    assert report.converted == ["layers.0.0"]
    x = torch.randn(8, 64) * torch.logspace(-3, 1, 64)  # values across decades: subnormal and normal ranges
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(8, 32) * 1e-3
    y = model(x1)
    y.backward(g)
    y_exact = exact(x2)
    y_exact.backward(g)
    w = exact.weight.detach()
    # forward: input and weight in e4m3
    fwd = product_error(x, E4M3, w.T, E4M3)
    assert ((y.detach() - y_exact.detach()).abs() <= fwd).all()
    # grad of the input: grad_output in e5m2, weight in e4m3
    gin = product_error(g, E5M2, w, E4M3)
    diff_in = (x1.grad - x2.grad).abs()
    assert (diff_in <= gin).all()
    # the rounding is there (an fp32 backward would be ~1e-6 of the bound)
    assert float((diff_in / gin).max()) > 0.01
    # grad of the weight: grad_output in e5m2, input in e4m3
    gw = product_error(g.T, E5M2, x, E4M3)
    diff_w = (model[0].weight.grad - exact.weight.grad).abs()
    assert (diff_w <= gw).all()
    assert float((diff_w / gw).max()) > 0.01


def test_plan_converts_decoder_linears_only() -> None:
    report = plan_float8(Tiny(), ["Block"], "tensorwise", size_filter=False)
    assert report.converted == [f"layers.{i}.{n}" for i in range(2) for n in ("q_proj", "up_proj")]
    assert report.kept == [f"layers.{i}.{n}" for i in range(2) for n in ("gate", "lora_A.default")]
    assert report.shape_skipped == [(f"layers.{i}.odd_proj", (24, 64)) for i in range(2)]
    assert report.float8_params == 2 * (64 * 64 + 128 * 64)
    text = report.describe(Float8Plan(emulate=True))
    assert "layers.0.odd_proj (24, 64)" in text and "multiples of 16" in text


LLAMA3_8B_LINEARS = {  # (out_features, in_features) inside each decoder layer
    "self_attn.q_proj": (4096, 4096),
    "self_attn.k_proj": (1024, 4096),
    "self_attn.v_proj": (1024, 4096),
    "self_attn.o_proj": (4096, 4096),
    "mlp.gate_proj": (14336, 4096),
    "mlp.up_proj": (14336, 4096),
    "mlp.down_proj": (4096, 14336),
}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_llama3_8b_keeps_k_and_v_in_bf16_as_torchao_does(recipe: str) -> None:
    """At Llama-3-8B's shapes (two layers, on the meta device) torchao's size filter keeps k_proj/v_proj (N = 1024,
    K = 4096) in bf16, where float8 is slower, and converts q/o/gate/up/down; the log line names what it kept."""
    import transformers
    from torchao.float8.float8_linear import Float8Linear

    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=8,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    plan = Float8Plan(recipe=recipe, all_gather=recipe == "tensorwise")
    report = convert_float8(model, ["LlamaDecoderLayer"], plan)
    for layer in model.model.layers:
        kinds = {name: type(layer.get_submodule(name)) for name in LLAMA3_8B_LINEARS}
        assert kinds == {
            name: torch.nn.Linear if name.endswith(("k_proj", "v_proj")) else Float8Linear
            for name in LLAMA3_8B_LINEARS
        }
    assert [name for name, _, _ in report.size_skipped] == [
        f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("k_proj", "v_proj")
    ]
    text = report.describe(plan)
    assert f"FP8: kept in bf16, below torchao's {recipe} size thresholds" in text
    assert "self_attn.k_proj (1024, 4096) x2, self_attn.v_proj (1024, 4096) x2" in text
    assert "10 decoder-layer linears in float8" in text


def test_size_rule_is_torchaos_auto_filter() -> None:
    """below_float8_size states torchao's thresholds (torchao.float8._auto_filter_for_recipe) for both recipes: the
    same answer on every shape of a grid around them, so a torchao that moves them fails here."""
    from torchao.float8 import _auto_filter_for_recipe

    sizes = [512, 1024, 1040, 2048, 2064, 4096, 4112, 8192, 14336]
    for recipe in ("tensorwise", "rowwise"):
        torchao_filter = _auto_filter_for_recipe(recipe, filter_fqns=[])
        for n in sizes:
            for k in sizes:
                with torch.device("meta"):
                    linear = torch.nn.Linear(k, n, bias=False)
                assert (below_float8_size(recipe, n, k) is None) == torchao_filter(linear, "layers.0.proj"), (
                    recipe,
                    n,
                    k,
                )


def test_convert_swaps_only_the_planned_linears() -> None:
    from torchao.float8.float8_linear import Float8Linear

    model = Tiny()
    convert_float8(model, ["Block"], Float8Plan(emulate=True, size_filter=False))
    assert isinstance(model.layers[0].q_proj, Float8Linear)
    for kept in (
        model.layers[0].gate,
        model.layers[0].odd_proj,
        model.layers[0].lora_A["default"],
        model.lm_head,
    ):
        assert type(kept) is torch.nn.Linear
    assert live_float8(model) and not live_float8(Tiny())
    # the export reads the plain master weight under torchao's float8-cast wrapper (same storage)
    weight = model.layers[0].q_proj.weight
    assert type(weight).__name__ == "WeightWithDynamicFloat8CastTensor"
    plain = without_float8_wrapper(weight)
    assert "float8" not in type(plain).__name__.lower() and plain.data_ptr() == weight._tensor.data_ptr()
    other = torch.ones(3)
    assert without_float8_wrapper(other) is other


def test_nothing_convertible_is_refused() -> None:
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(24, 24))])
    with pytest.raises(ConfigError, match="no decoder-layer linear.*multiples of 16"):
        convert_float8(model, ["Sequential"], Float8Plan(emulate=True))
    # every linear below torchao's thresholds: refused by name, with the knob that converts them anyway
    model.layers = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(64, 64))])
    with pytest.raises(
        ConfigError, match="below torchao's tensorwise size thresholds.*fp8_size_filter=false"
    ):
        convert_float8(model, ["Sequential"], Float8Plan(emulate=True))


def test_hardware_refusals() -> None:
    assert "no FP8 matmul hardware on cpu" in str(fp8_hardware_problem("cpu", None))
    assert "compute capability 8.0" in str(fp8_hardware_problem("cuda", (8, 0), "NVIDIA A100"))
    assert fp8_hardware_problem("cuda", (9, 0), "NVIDIA H100") is None
    assert fp8_hardware_problem("cuda", (8, 9), "NVIDIA L4") is None
    with pytest.raises(
        ConfigError, match="mixed_precision=fp8: no FP8 matmul hardware on cpu.*fp8_emulate=true"
    ):
        check_float8_hardware(Float8Plan(), torch.device("cpu"))
    assert "emulates" in str(check_float8_hardware(Float8Plan(emulate=True), torch.device("cpu")))
    assert "torch_compile=true" in str(warn_without_compile(False))
    assert warn_without_compile(True) is None


def test_config_keys_and_refusals() -> None:
    assert TrainArgs(mixed_precision="fp8").float8_plan() == Float8Plan("tensorwise", False, True, True)
    assert TrainArgs(mixed_precision="fp8", fp8_size_filter=False).float8_plan().size_filter is False
    assert TrainArgs(mixed_precision="fp8", fp8_recipe="rowwise").float8_plan().all_gather is False
    with pytest.raises(ConfigError, match="fp8_all_gather=true with fp8_recipe=rowwise.*tensorwise"):
        TrainArgs(output_dir="o", mixed_precision="fp8", fp8_recipe="rowwise", fp8_all_gather=True).validate()
    refusals = {
        "load_in_4bit=true \\(QLoRA\\)": {"load_in_4bit": True},
        "use_peft=true \\(LoRA\\)": {"use_peft": True},
        "tp_size=2 and fp8_all_gather=true": {"tp_size": 2, "all_gather": True},
        "fsdp_cpu_ram_efficient_loading=true": {"ram_efficient_loading": True},
        "optim=muon": {"optim": "muon"},
    }
    base = {"load_in_4bit": False, "use_peft": False, "tp_size": 1, "ram_efficient_loading": None}
    for message, change in refusals.items():
        with pytest.raises(ConfigError, match=f"mixed_precision=fp8 with {message}.*(use|set) "):
            check_float8_combination(**{**base, **change})
    check_float8_combination(**base)
    # FP8 under tensor parallel: torchao's float8 TP styles (tests/distributed/test_tensor_parallel.py); the weights'
    # FSDP2 float8 all-gather on 2-D DTensors is the part refused.
    check_float8_combination(**{**base, "tp_size": 2, "all_gather": False})
    # rank-0-only loading: unset is resolved off under fp8 (every rank converts its own copy)
    f = FSDPArgs()
    assert "mixed_precision=fp8" in f.resolve_ram_efficient_loading(8, resize_embeddings=False, float8=True)
    assert f.fsdp_cpu_ram_efficient_loading is False


def test_parse_refuses_lora_with_fp8(tmp_path) -> None:  # type: ignore[no-untyped-def]
    argv = [
        "--model_name_or_path",
        "m",
        "--dataset_name",
        "d",
        "--output_dir",
        str(tmp_path / "o"),
        "--mixed_precision",
        "fp8",
        "--use_peft",
        "true",
    ]
    with pytest.raises(ConfigError, match="use_peft=true \\(LoRA\\) is not supported"):
        parse_config(argv)


def test_probe_limit_allows_the_live_float8_rounding() -> None:
    noise = 0.01
    assert probe_limit(torch.bfloat16, 1.0, noise) == pytest.approx(max(0.05, NOISE_MARGIN * noise))
    assert probe_limit(torch.bfloat16, 1.0, noise, float8=True) == pytest.approx(NOISE_MARGIN * noise * 16)
    assert FLOAT8_NOISE_RATIO == 16.0  # e4m3's unit roundoff 2^-4 over bf16's 2^-8


def test_memory_plan_counts_float8_weights_and_all_gather_savings() -> None:
    import transformers

    from hf_fsdp2.plan import PlanSettings, plan_memory
    from hf_fsdp2.plan.table import format_plan

    hidden, inter, layers, kv = 256, 512, 3, 2  # head_dim 64: q/o 256x256, k/v 128x256
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv,
    )
    per_layer = 2 * hidden * hidden + 2 * 128 * hidden + 3 * hidden * inter
    norms = 2 * hidden
    base = {
        "world_size": 4,
        "micro_batch": 1,
        "seq_len": 32,
        "device_type": "cpu",
        "gradient_accumulation_steps": 2,
        "fp8_size_filter": False,  # these linears are all below torchao's thresholds
    }
    # with the size filter (the default) the planner keeps them in bf16 as the run does: nothing in float8
    filtered = plan_memory(config, PlanSettings(**{**base, "fp8_size_filter": True}, mixed_precision="fp8"))
    assert filtered.float8 is not None and filtered.float8.linears == 0
    bf16 = plan_memory(config, PlanSettings(**base, mixed_precision="bf16"))
    fp8 = plan_memory(config, PlanSettings(**base, mixed_precision="fp8"))
    assert bf16.float8 is None and fp8.float8 is not None
    f = fp8.float8
    assert (f.linears, f.weights) == (7 * layers, layers * per_layer)
    assert (
        f.gathers_per_step == 2 * 2
    )  # forward + backward re-gather (reshard_after_forward), 2 micro-batches
    received = layers * per_layer * 3 // 4 * 4  # 3/4 of each weight comes from the other ranks, 4 gathers
    assert (f.bf16_bytes, f.fp8_bytes, f.saved_bytes) == (2 * received, received, received)
    # each decoder-layer unit gathers its float8 weights at 1 byte and its norms in bf16
    layer_units = [u for u in fp8.units if u.name not in ("embedding", "tail", "root")]
    assert [u.gathered_bytes for u in layer_units] == [per_layer + 2 * norms] * layers
    assert [u.gathered_bytes for u in bf16.units if u.name == layer_units[0].name] == [
        2 * per_layer + 2 * norms
    ]
    assert "21 decoder-layer linears in float8" in format_plan(fp8)
    # without fp8_all_gather the all-gather is bf16: no saving
    plain = plan_memory(config, PlanSettings(**base, mixed_precision="fp8", fp8_all_gather=False)).float8
    assert plain is not None and plain.saved_bytes == 0


def test_doctor_says_the_same_before_a_run() -> None:
    from hf_fsdp2.doctor.layouts import float8_findings

    argv = ["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", "o"]
    assert float8_findings(parse_config(argv), on_gpu=False) == []
    refused = float8_findings(parse_config([*argv, "--mixed_precision", "fp8"]), on_gpu=False)
    assert [f.level for f in refused] == ["error"]
    assert "no FP8 matmul hardware on cpu" in refused[0].message and "fp8_emulate=true" in refused[0].message
    emulated = float8_findings(
        parse_config([*argv, "--mixed_precision", "fp8", "--fp8_emulate", "true"]), False
    )
    assert [(f.check, f.level) for f in emulated] == [("fp8", "warning"), ("fp8 compile", "warning")]


def test_only_the_verified_recipes_take_fp8_and_the_doctor_says_so() -> None:
    """sft and cpt are verified with float8 linears (tests/distributed/test_float8.py); the recipes with a reference,
    reward or score model, or weights sent to a vLLM server, are refused by name, in the run and in the doctor."""
    from hf_fsdp2.config.plans import MeshPlan
    from hf_fsdp2.doctor.layouts import capability_findings, float8_findings
    from hf_fsdp2.methods import get_method
    from hf_fsdp2.run.registry import check_capabilities

    argv = [
        "--model_name_or_path",
        "m",
        "--dataset_name",
        "d",
        "--output_dir",
        "o",
        "--mixed_precision",
        "fp8",
        "--fp8_emulate",
        "true",
    ]
    fp8, bf16 = parse_config(argv), parse_config(argv[:6])
    for name in ("sft", "cpt"):
        check_capabilities(get_method(name), fp8, MeshPlan())
    for name in ("dpo", "kto", "rm", "grpo"):
        check_capabilities(get_method(name), bf16, MeshPlan())  # other precisions pass
        with pytest.raises(ConfigError, match=f"mixed_precision=fp8 is not supported by the {name} recipe"):
            check_capabilities(get_method(name), fp8, MeshPlan())
    found = capability_findings(fp8, method=get_method("grpo"), world=1)
    assert [(f.check, f.level) for f in found] == [("layouts", "error")]
    assert "float8 runs with the sft and cpt recipes" in found[0].message
    assert float8_findings(fp8, False, get_method("grpo")) == []  # said once, by the layouts finding
    assert [f.level for f in float8_findings(parse_config(argv), False, get_method("sft"))] == [
        "warning",
        "warning",
    ]
