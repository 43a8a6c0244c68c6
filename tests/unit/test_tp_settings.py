"""Tensor parallel's plan and refusals, without processes: the family's base_model_tp_plan expanded to the model's
modules; a family without a plan, MoE and other styles torch cannot apply, and the settings that do not compose with
TP refused naming the reason and the fix."""

from __future__ import annotations

import pytest
import torch
import transformers

from hf_fsdp2.config import ConfigError
from hf_fsdp2.parallel.tensor import TensorParallelError, check_tp_settings, tp_plan_for, tp_prepared_by_torch

SMALL = dict(vocab_size=97, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4)


def _model(cls: str, **extra: object) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**SMALL, **extra))


def test_the_family_plan_is_expanded_to_every_decoder_layer_with_sequence_parallel_around_it() -> None:
    plan = tp_plan_for(_model("Qwen3Config", num_key_value_heads=2, head_dim=8, tie_word_embeddings=True))
    assert plan.family == "qwen3" and plan.tied
    assert plan.styles["model.layers.1.self_attn.k_proj"] == "colwise"
    assert plan.styles["model.layers.0.mlp.down_proj"] == "rowwise"
    assert plan.styles["model.layers.0.self_attn.q_norm"] == "replicated_with_grad_allreduce"
    # torchtitan's layout: the blocks gather their input, the norms run on sequence parts, the vocabulary is split.
    assert plan.styles["model.layers.0.self_attn"] == plan.styles["model.layers.1.mlp"] == "gather_sequence"
    assert plan.styles["model.layers.1.input_layernorm"] == plan.styles["model.norm"] == "sequence_norm"
    assert plan.styles["model.layers.0"] == "split_sequence"
    assert plan.styles["model.embed_tokens"] == "vocab_embedding" and plan.styles["lm_head"] == "vocab_head"
    assert list(plan.styles)[:2] == ["model.embed_tokens", "model.layers.0"]  # applied in this order
    assert list(plan.styles)[-1] == "lm_head"
    # per layer: q/k/v, q/k norms, o, gate/up/down, 2 blocks, 2 norms; then embedding, first layer, final norm, head
    assert len(plan.styles) == 2 * 13 + 4
    text = plan.describe(2)
    assert (
        "10 colwise, 4 gather_sequence, 4 replicated_with_grad_allreduce, 4 rowwise, 5 sequence_norm" in text
    )
    assert "loss parallel under the chunked loss" in text and "(tied: one weight)" in text


def test_a_decoder_layer_part_that_is_neither_a_split_block_nor_a_norm_is_refused_by_name() -> None:
    model = _model("LlamaConfig", num_key_value_heads=2)
    model.model.layers[0].adapter = torch.nn.Linear(32, 32)  # a parameterised module the plan does not name
    with pytest.raises(TensorParallelError, match=r"model\.layers\.0\.adapter \(Linear, .* neither a block"):
        tp_plan_for(model)


def test_a_family_without_a_plan_is_refused_by_name() -> None:
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=1, n_head=4)
    )
    with pytest.raises(
        TensorParallelError, match=r"GPT2LMHeadModel \(model_type 'gpt2'\) has no tensor-parallel plan"
    ):
        tp_plan_for(model)


def test_moe_experts_and_fused_styles_are_refused_with_the_reason() -> None:
    moe = _model(
        "Qwen3MoeConfig",
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
    )
    # transformers <= 5.24 names the experts' fused styles in the TP plan; 5.25 moves experts to an EP plan.
    with pytest.raises(
        TensorParallelError,
        match=r"qwen3_moe('s base_model_tp_plan uses \['moe_tp_experts', "
        r"'packed_colwise'\].*no torch DTensor equivalent| is a "
        r"mixture-of-experts model \(2 expert blocks, e\.g\. "
        r"model\.layers\.0\.mlp\.experts\).*not experts.*tp_size=1)",
    ):
        tp_plan_for(moe)
    with pytest.raises(
        TensorParallelError, match=r"phi3's base_model_tp_plan uses \['colwise_gather_output'"
    ):
        tp_plan_for(_model("Phi3Config", num_key_value_heads=2, pad_token_id=0))


_SETTINGS = dict(use_peft=False, load_in_4bit=False, liger=False, ram_efficient_loading=None)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(use_peft=True), "use_peft / load_in_4bit is not supported: LoRA wraps the linear layers"),
        (dict(load_in_4bit=True), "use_peft / load_in_4bit is not supported"),
        (dict(liger=True), "use_liger_kernel=true is not supported"),
        (dict(ram_efficient_loading=True), "fsdp_cpu_ram_efficient_loading=true is not supported.*set "
                                           "fsdp_cpu_ram_efficient_loading=false"),
    ],
)  # fmt: skip
def test_settings_that_do_not_compose_with_tp_are_refused(settings: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=f"tp_size=2 with {message}"):
        check_tp_settings(2, **(_SETTINGS | settings))
    assert check_tp_settings(1, **(_SETTINGS | settings)) == {}  # nothing to refuse without TP


def test_unset_ram_efficient_loading_is_turned_off_under_tp_with_a_log_line_and_compile_is_kept() -> None:
    off = check_tp_settings(2, **_SETTINGS)
    assert off.keys() == {"fsdp_cpu_ram_efficient_loading"}  # torch_compile is not turned off any more
    assert off["fsdp_cpu_ram_efficient_loading"].startswith("fsdp_cpu_ram_efficient_loading=false (tp_size=2")
    assert check_tp_settings(2, **(_SETTINGS | {"ram_efficient_loading": False})) == {}


def test_accelerates_own_tp_prepare_is_skipped_for_the_block_only() -> None:
    from types import SimpleNamespace

    from accelerate import ParallelismConfig

    config = ParallelismConfig(dp_shard_size=2, tp_size=2)
    with tp_prepared_by_torch(SimpleNamespace(parallelism_config=config)):
        assert not config.tp_enabled  # accelerate's _prepare_tp (ImportError on transformers 5) does not run
    assert config.tp_size == 2 and config.tp_enabled

    class Stubborn:  # an accelerate whose tp_enabled no longer reads tp_size
        tp_size, tp_enabled = 2, True

    stubborn = Stubborn()
    with (
        pytest.raises(RuntimeError, match="tp_enabled no longer follows tp_size"),
        tp_prepared_by_torch(SimpleNamespace(parallelism_config=stubborn)),
    ):
        pass
    assert stubborn.tp_size == 2


def test_only_methods_whose_step_counts_a_tp_groups_batch_once_accept_tp() -> None:
    from hf_fsdp2.config import parse_config
    from hf_fsdp2.config.plans import MeshPlan
    from hf_fsdp2.methods import get_method
    from hf_fsdp2.run.registry import check_capabilities

    cfg = parse_config(["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", "o"])
    for name in ("sft", "cpt"):
        check_capabilities(get_method(name), cfg, MeshPlan(tp=2))
    for name in ("dpo", "kto", "rm", "grpo"):
        with pytest.raises(
            ConfigError, match=f"tp_size=2 is not supported by the {name} recipe.*sft and cpt"
        ):
            check_capabilities(get_method(name), cfg, MeshPlan(tp=2))
        check_capabilities(get_method(name), cfg, MeshPlan())


def test_the_memory_plan_names_tp_as_not_modelled_and_not_as_hsdp() -> None:
    from hf_fsdp2.plan.settings import PlanError, PlanSettings

    text = PlanSettings(world_size=4, dp_shard=2, tp=2, device_type="cpu").describe()
    assert text.startswith("world 4, tensor parallel 2 (not modelled: the figures are FSDP2's over 2 ranks")
    assert "HSDP" not in text
    hsdp = PlanSettings(world_size=8, dp_shard=2, tp=2, device_type="cpu")
    assert hsdp.describe().startswith("world 8 (HSDP: 2 x 2), tensor parallel 2")
    assert [hsdp.shard_index(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]  # tp innermost
    with pytest.raises(PlanError, match="dp_shard_size=4 x tp_size=2 must divide world_size=4"):
        PlanSettings(world_size=4, dp_shard=4, tp=2)
