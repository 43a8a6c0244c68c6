"""LoRA helpers in one process: config, dtypes, memory report, merge rows, offline merge CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from support.numerics import assert_same_maths
from support.tiny import make_tiny_llama_dir
from transformers import LlamaForCausalLM

from hf_fsdp2.cli import main as cli_main
from hf_fsdp2.config.plans import LoraSettings
from hf_fsdp2.lora.adapter import LoraError, apply_lora, memory_report
from hf_fsdp2.lora.build import lora_config
from hf_fsdp2.lora.merge import merge_adapter_offline, merged_local_weights
from hf_fsdp2.lora.save import gather_adapter_state_dict


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama_dir(tmp_path_factory.mktemp("lora_unit") / "model", seed=1)


def _trained(model_dir: Path, dtype: torch.dtype = torch.float32, **kw) -> torch.nn.Module:
    base = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model = apply_lora(base, LoraSettings(r=4, alpha=8, dropout=0.0, **kw), seed=0)
    with torch.no_grad():  # B starts at zero: give the adapter a non-zero delta as training would
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    return model


def test_all_linear_is_peft_shorthand_and_names_are_kept() -> None:
    assert lora_config(LoraSettings(target_modules=["all-linear"])).target_modules == "all-linear"
    cfg = lora_config(LoraSettings(target_modules=["q_proj", "v_proj"], use_rslora=True))
    assert set(cfg.target_modules) == {"q_proj", "v_proj"} and cfg.use_rslora


def test_frozen_base_keeps_its_dtype_and_the_adapter_is_fp32(model_dir: Path) -> None:
    model = _trained(model_dir, torch.bfloat16, modules_to_save=["lm_head"])
    trainable = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p.dtype for n, p in model.named_parameters() if not p.requires_grad}
    assert trainable and set(trainable.values()) == {torch.float32}
    assert set(frozen.values()) == {torch.bfloat16}
    assert any("modules_to_save" in n for n in trainable)  # lm_head trained in full, in fp32


def test_memory_report_counts_trainable_and_adam_state(model_dir: Path) -> None:
    model = _trained(model_dir)
    report = memory_report(model)
    lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert report["trainable_params"] == lora < report["total_params"]
    assert report["optimizer_state_bytes"] == 2 * 4 * lora


def test_seeded_init_does_not_depend_on_earlier_rng_use(model_dir: Path) -> None:
    def adapter() -> dict[str, torch.Tensor]:
        base = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        return gather_adapter_state_dict(apply_lora(base, LoraSettings(r=4), seed=5))

    a = adapter()
    torch.rand(1000)  # other code draws from the global RNG in between
    b = adapter()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_unknown_target_module_names_the_linear_layers(model_dir: Path) -> None:
    base = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with pytest.raises(LoraError, match="q_proj"):
        apply_lora(base, LoraSettings(target_modules=["qkv"]))


@pytest.mark.parametrize("rslora", [False, True], ids=["lora", "rslora"])
def test_merged_weights_equal_peft_merge_and_unload(model_dir: Path, rslora: bool) -> None:
    # A float64 base: the merges add W + s * B @ A in other orders. The adapter stays fp32 (apply_lora), and
    # PEFT takes B @ A in the adapter's dtype: fp32 rounding over r products and the add.
    model = _trained(model_dir, torch.float64, use_rslora=rslora, modules_to_save=["lm_head"])
    with torch.no_grad():
        model.base_model.model.lm_head.modules_to_save["default"].weight.add_(1.0)
    ours = merged_local_weights(model)  # one process: the local rows are all rows
    expected = dict(model.merge_and_unload().named_parameters())
    assert sorted(ours) == sorted(expected)
    for name, w in expected.items():
        if w.dtype == torch.float32:  # a modules_to_save copy (trainable, fp32): copied, not computed
            assert torch.equal(ours[name], w.detach()), name
        else:
            assert_same_maths(ours[name], w.detach(), terms=4 + 1, rounding=torch.float32, name=name)


def test_merge_adapter_cli_writes_a_merged_folder(model_dir: Path, tmp_path: Path) -> None:
    model = _trained(model_dir)
    model.save_pretrained(tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    out = tmp_path / "merged"
    assert cli_main(["merge-adapter", str(tmp_path / "adapter"), str(out), "--dtype", "float32"]) == 0
    merged = load_file(out / "model.safetensors")
    base = load_file(model_dir / "model.safetensors")
    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    for name, w in base.items():
        prefix = "base_model.model." + name.removesuffix(".weight")
        a, b = adapter.get(f"{prefix}.lora_A.weight"), adapter.get(f"{prefix}.lora_B.weight")
        expected = w if a is None else w + 2.0 * (b @ a)  # alpha / r = 8 / 4
        torch.testing.assert_close(merged[name], expected, rtol=1e-6, atol=1e-6, msg=name)
    # The merged folder computes what base + adapter compute.
    reloaded = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    peft = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(model_dir), str(tmp_path / "adapter"))
    ids = torch.randint(3, 1000, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(input_ids=ids).logits, peft(input_ids=ids).logits, rtol=1e-4, atol=1e-4
        )
    # A non-empty OUT_DIR is refused (exit 2) unless --overwrite.
    assert cli_main(["merge-adapter", str(tmp_path / "adapter"), str(out)]) == 2


def test_merge_adapter_refuses_a_folder_without_an_adapter(tmp_path: Path) -> None:
    with pytest.raises(LoraError, match="adapter_config.json"):
        merge_adapter_offline(tmp_path, tmp_path / "out")


def _family_model(family: str) -> torch.nn.Module:
    """A tiny random-init model of a family of tests/support/families.py, built in memory."""
    import transformers
    from support.families import _COMMON, FAMILIES

    cls, extra = FAMILIES[family]
    config = getattr(transformers, cls)(vocab_size=128, **dict(_COMMON, **extra))
    if isinstance(config.pad_token_id, int) and config.pad_token_id >= 128:  # SmolLM3's default is 128004
        config.pad_token_id = 0
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(
    ("family", "left_out", "kept"),
    [
        # PEFT itself refuses out_proj on Falcon-H1 (by model type), not on Granite 4: both mixers hand it to the
        # fused CUDA kernel.
        ("falcon_h1", "model.layers.0.mamba.out_proj", "model.layers.0.mamba.in_proj"),
        ("granite4", "model.layers.0.mamba.out_proj", "model.layers.0.mamba.in_proj"),
        (
            "llama4_text",
            "model.layers.1.feed_forward.router",
            "model.layers.1.feed_forward.shared_expert.up_proj",
        ),
    ],
)
def test_all_linear_leaves_out_what_cannot_take_an_adapter(family: str, left_out: str, kept: str) -> None:
    model = apply_lora(_family_model(family), LoraSettings(r=4, alpha=8, dropout=0.0), seed=0)
    wrapped = {n.removeprefix("base_model.model.") for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert kept in wrapped and left_out not in wrapped, sorted(wrapped)
    assert left_out in model.peft_config["default"].exclude_modules  # written to adapter_config.json
    ids = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids).logits.sum().backward()  # trains (Llama 4's router kept its tuple)
    # Named explicitly, it is refused with the reason.
    with pytest.raises(LoraError, match=r"names (out_proj|router) and .* cannot take LoRA"):
        apply_lora(
            _family_model(family), LoraSettings(target_modules=["q_proj", left_out.rsplit(".", 1)[-1]])
        )


def test_gated_deltanet_projections_take_lora_and_a_plain_llama_excludes_nothing() -> None:
    from hf_fsdp2.lora.build import lora_exclusions

    # Qwen3.5's gated DeltaNet calls its out_proj as a module (no fused kernel reads the weight): it is adapted.
    model = apply_lora(_family_model("qwen3_5"), LoraSettings(r=4, alpha=8, dropout=0.0), seed=0)
    wrapped = {n.removeprefix("base_model.model.") for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert (
        "model.layers.0.linear_attn.out_proj" in wrapped
        and "model.layers.0.linear_attn.in_proj_qkv" in wrapped
    )
    assert lora_exclusions(_family_model("llama3_untied")) == {}


# The families of 2026 (tests/support/families.py); the matrix's 2-rank LoRA rows cover three of them.
NEW_FAMILIES = (
    "gpt_oss",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
    "glm4_moe",
    "deepseek_v3",
    "falcon_h1",
    "granite4",
    "llama4_text",
    "smollm3",
    "olmo3",
    "exaone4",
)


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_all_linear_lora_trains_and_reloads_with_plain_peft_on_every_new_family(
    family: str, tmp_path: Path
) -> None:
    """What docs/models.md says of LoRA on the new families, on each: all-linear adapts every decoder layer, starts
    at the base's logits (B = 0), every adapter it adds is on the forward path (a non-zero gradient for its B; experts
    only where the router sent a token), the base takes no gradient, and the saved adapter reloads with plain PEFT
    on the base to the same logits."""
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    base_logits = _family_model(family).eval()(input_ids=ids).logits
    model = apply_lora(_family_model(family), LoraSettings(r=4, alpha=8, dropout=0.0), seed=0)
    assert torch.equal(model.eval()(input_ids=ids).logits, base_logits)
    adapted = {n for n, m in model.named_modules() if hasattr(m, "lora_A") and m.lora_A}
    layers = {int(n.split(".layers.", 1)[1].split(".", 1)[0]) for n in adapted if ".layers." in n}
    assert layers == {0, 1}, sorted(adapted)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(".lora_" in n for n in grads), sorted(grads)
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads.values()), family
    idle = [
        n for n, g in grads.items() if ".lora_B." in n and not float(g.abs().sum()) and ".experts" not in n
    ]
    assert not idle, f"adapters off the forward path: {idle}"
    with torch.no_grad():  # a trained adapter: B moved off zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    model.eval()
    want = model(input_ids=ids).logits
    assert not torch.equal(want, base_logits)
    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(_family_model(family), tmp_path / "adapter").eval()
    torch.testing.assert_close(reloaded(input_ids=ids).logits, want, rtol=0, atol=1e-6)
