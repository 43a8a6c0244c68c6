"""Expert parallel's refusals before the model loads, each naming the combination and the fix: ``ep_size`` not
dividing ``dp_shard x cp``, with tensor parallel, with FP8; a dense model, a family whose experts transformers'
experts interface does not dispatch (Llama 4), experts that do not split into whole experts per rank. And the mesh it
describes (``efsdp = dp_shard x cp / ep``)."""

from __future__ import annotations

import pytest
import transformers
from support.families import _COMMON, FAMILIES

from hf_fsdp2.config import ConfigError
from hf_fsdp2.config.float8 import check_float8_combination
from hf_fsdp2.config.plans import MeshPlan, resolve_mesh
from hf_fsdp2.model import meta_model
from hf_fsdp2.parallel.experts import ExpertParallelError, check_expert_parallel


def _config(family: str, **over: object) -> object:
    name, extra = FAMILIES[family]
    return meta_model(getattr(transformers, name)(vocab_size=256, **{**_COMMON, **extra, **over}))


def test_ep_borrows_data_ranks_and_describes_the_expert_shards() -> None:
    mesh = resolve_mesh(8, dp_replicate=None, dp_shard=None, tp=None, cp=None, ep=4)
    assert (mesh.dp_shard, mesh.ep, mesh.efsdp, mesh.world) == (8, 4, 2, 8)
    assert "expert parallel 4" in mesh.describe() and "efsdp = dp_shard 8 x cp 1 / ep 4" in mesh.describe()
    mesh = resolve_mesh(8, dp_replicate=2, dp_shard=2, tp=None, cp=2, ep=4)  # ep over dp_shard x cp
    assert (mesh.fsdp_shard, mesh.efsdp) == (4, 1)


@pytest.mark.parametrize(
    "sizes, message",
    [
        (dict(ep=3), "ep_size=3 does not divide dp_shard_size x cp_size = 4 x 1 = 4"),
        (dict(dp_replicate=2, ep=4), "ep_size=4 does not divide dp_shard_size x cp_size = 2 x 1 = 2"),
        (dict(tp=2, ep=2), "ep_size=2 with tp_size=2 is not supported"),
        (dict(ep=0), "ep_size=0 must be >= 1"),
    ],
)  # fmt: skip
def test_ep_sizes_the_mesh_cannot_hold_are_refused(sizes: dict, message: str) -> None:
    kwargs = dict(dp_replicate=None, dp_shard=None, tp=None, cp=None) | sizes
    with pytest.raises(ConfigError, match=message):
        resolve_mesh(4, **kwargs)


def test_fp8_with_ep_is_refused() -> None:
    with pytest.raises(ConfigError, match="mixed_precision=fp8 with ep_size=2 is not supported"):
        check_float8_combination(
            load_in_4bit=False, use_peft=False, tp_size=1, ram_efficient_loading=None, ep_size=2
        )


def test_methods_not_verified_with_ep_are_refused_by_name() -> None:
    """sft and cpt run expert parallel; a method with a reference, reward or score model or weight syncs is refused
    before any work (an ep_size the registry did not know before: every method ran it unchecked)."""
    from hf_fsdp2.config import parse_config
    from hf_fsdp2.methods import get_method
    from hf_fsdp2.run.registry import check_capabilities

    cfg = parse_config(
        ["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", "o", "--ep_size", "2"]
    )
    mesh = MeshPlan(dp_shard=2, ep=2)
    for name in ("sft", "cpt"):
        check_capabilities(get_method(name), cfg, mesh)
    for name in ("dpo", "kto", "rm", "grpo"):
        with pytest.raises(
            ConfigError, match=f"ep_size>1 is not supported by the {name} recipe .* sft and cpt"
        ):
            check_capabilities(get_method(name), cfg, mesh)


def test_models_expert_parallel_refuses_are_named() -> None:
    mesh = MeshPlan(dp_shard=4, ep=2)
    with pytest.raises(ExpertParallelError, match="LlamaForCausalLM .* is not a mixture-of-experts model"):
        check_expert_parallel(_config("llama_tied"), mesh)
    with pytest.raises(ExpertParallelError, match="feed_forward.experts \\(Llama4TextExperts\\)"):
        check_expert_parallel(_config("llama4_text"), mesh)
    with pytest.raises(ExpertParallelError, match="ep_size=4 does not divide the model's 6 routed experts"):
        check_expert_parallel(_config("qwen3_moe", num_experts=6), MeshPlan(dp_shard=4, ep=4))
    with pytest.raises(ExpertParallelError, match="leaves 2 experts per rank, which its efsdp .* = 4"):
        check_expert_parallel(_config("qwen3_moe"), MeshPlan(dp_shard=8, ep=2))
    layout = check_expert_parallel(_config("gpt_oss"), mesh)
    assert layout.tensors == ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    assert layout.num_experts == 4 and len(layout.modules) == 2
    layout = check_expert_parallel(
        _config("deepseek_v3"), mesh
    )  # shared experts stay dense, dense first layer
    assert layout.modules == ("model.layers.1.mlp.experts",)


def test_lora_on_the_experts_is_not_taken_for_experts_outside_the_interface() -> None:
    """LoRA on the fused experts: PEFT's ``ParamWrapper`` takes the experts' name (``mlp.experts``) and holds them as
    its ``base_layer``; the run reads the experts after the adapter is applied (run/build.py), where the wrapper was
    refused as experts outside the interface before (ep_size with lora_target_parameters failed at start-up)."""
    import torch

    from hf_fsdp2.config.plans import LoraSettings
    from hf_fsdp2.lora.adapter import apply_lora

    name, extra = FAMILIES["qwen3_moe"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, name)(vocab_size=256, **{**_COMMON, **extra})
    )
    settings = LoraSettings(r=4, alpha=8, dropout=0.0, target_parameters=["all-experts"])
    layout = check_expert_parallel(apply_lora(model, settings, seed=0), MeshPlan(dp_shard=2, ep=2))
    assert layout.num_experts == 4 and len(layout.modules) == 2
    assert all(m.endswith("mlp.experts.base_layer.base_layer") for m in layout.modules), layout.modules
