"""LoRA and QLoRA on composite checkpoints (a vision tower + projector + language model in one folder): the adapter
targets the language model only, whatever the target list; PEFT loads it back on the composite; QLoRA quantises the
language model's decoder layers only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from peft import PeftModel
from support.composites import COMPOSITE_FAMILIES, make_composite_dir

from hf_fsdp2.composite import COMPOSITES
from hf_fsdp2.config.plans import LoraSettings
from hf_fsdp2.lora.adapter import LoraError, apply_lora
from hf_fsdp2.lora.build import composite_parts

_ARCH = {
    "gemma3_vlm": "Gemma3ForConditionalGeneration",
    "qwen3_5_vlm": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe_vlm": "Qwen3_5MoeForConditionalGeneration",
    "llama4_vlm": "Llama4ForConditionalGeneration",
    "mistral3": "Mistral3ForConditionalGeneration",
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_composites")
    return {f: make_composite_dir(root / f, f, processor=False) for f in COMPOSITE_FAMILIES}


def _load(folder: Path) -> torch.nn.Module:
    return transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)


def _adapted(model: torch.nn.Module) -> set[str]:
    return {n.removeprefix("base_model.model.") for n, m in model.named_modules() if hasattr(m, "lora_A")}


def _outside(names: set[str], family: str) -> set[str]:
    spec = COMPOSITES[_ARCH[family]]
    return {n for n in names if not n.startswith(spec.language_model + ".")}


@pytest.mark.parametrize("family", list(COMPOSITE_FAMILIES))
def test_lora_on_a_composite_adapts_its_language_model_only(folders: dict[str, Path], family: str) -> None:
    base = _load(folders[family])
    spec = COMPOSITES[_ARCH[family]]
    assert composite_parts(base) == (*spec.tower, *spec.projector)
    tower_linears = [
        n
        for n, m in base.named_modules()
        if isinstance(m, torch.nn.Linear)
        and n.startswith(tuple(p + "." for p in spec.tower + spec.projector))
    ]
    assert tower_linears  # what all-linear would adapt without the exclusion
    model = apply_lora(base, LoraSettings(r=4, alpha=8, dropout=0.0), seed=0)
    adapted = _adapted(model)
    assert adapted and not _outside(adapted, family), sorted(_outside(adapted, family))
    # The tower's parameters are frozen (PEFT's base) and take no adapter: nothing of them trains.
    assert not [n for n, p in model.named_parameters() if p.requires_grad and ".lora_" not in n]


@pytest.mark.parametrize("family", ["gemma3_vlm", "llama4_vlm", "mistral3"])
def test_a_target_list_of_names_the_tower_shares_adapts_the_language_model_only(
    folders: dict[str, Path], family: str
) -> None:
    """SigLIP's, Llama 4's and Pixtral's attention have q_proj and v_proj too: a list of names is no refusal, the
    language model's modules take the adapter."""
    base = _load(folders[family])
    tower_q = [n for n, _ in base.named_modules() if n.endswith(".q_proj") and _outside({n}, family)]
    assert tower_q
    model = apply_lora(
        base, LoraSettings(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"]), seed=0
    )
    adapted = _adapted(model)
    assert adapted and not _outside(adapted, family), sorted(_outside(adapted, family))
    assert {n.rsplit(".", 1)[-1] for n in adapted} == {"q_proj", "v_proj"}


def test_a_target_only_the_tower_has_is_refused_naming_the_language_models_modules(
    folders: dict[str, Path],
) -> None:
    with pytest.raises(LoraError, match=r"language model's linear module names .* are \[.*'q_proj'"):
        apply_lora(_load(folders["gemma3_vlm"]), LoraSettings(target_modules=["fc1"]), seed=0)


@pytest.mark.parametrize("family", ["gemma3_vlm", "qwen3_5_vlm", "llama4_vlm"])
def test_a_composite_adapter_loads_on_the_composite_with_plain_peft(
    folders: dict[str, Path], tmp_path: Path, family: str
) -> None:
    model = apply_lora(_load(folders[family]), LoraSettings(r=4, alpha=8, dropout=0.0), seed=0)
    with torch.no_grad():  # lora_B starts at zero: a delta as training would leave
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(_load(folders[family]), tmp_path / "adapter").eval()
    assert _adapted(reloaded) == _adapted(
        model
    )  # exclude_modules read back: the tower takes none on load either
    ids = torch.randint(3, 1000, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model.eval()(input_ids=ids).logits
        base = _load(folders[family])(input_ids=ids).logits
        got = reloaded(input_ids=ids).logits
    assert float((want - base).abs().max()) > 1e-4  # the adapter changes the logits
    assert torch.allclose(got, want, atol=1e-6)


def test_qlora_quantises_the_language_models_layers_only(folders: dict[str, Path]) -> None:
    pytest.importorskip("torchao")
    from hf_fsdp2.lora.quantize import quantize_base

    model = _load(folders["gemma3_vlm"])
    tower = {
        n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("model.vision_tower.")
    }
    # Named or not (the composite's _no_split_modules lists SigLIP's encoder layer too), the tower stays as loaded.
    report = quantize_base(model, ("Gemma3DecoderLayer", "SiglipEncoderLayer"), shards=2)
    nf4 = [n for n, p in model.named_parameters() if type(p).__name__ == "NF4Tensor"]
    assert nf4 and all(n.startswith("model.language_model.layers.") for n in nf4), nf4
    assert report.weights == 2 * 7
    for name, param in model.named_parameters():
        if name in tower:
            assert type(param).__name__ != "NF4Tensor" and torch.equal(param, tower[name]), name
    model = apply_lora(model, LoraSettings(r=4, alpha=8, dropout=0.0), seed=0)
    assert not _outside(_adapted(model), "gemma3_vlm")
    assert torch.isfinite(model(input_ids=torch.tensor([[1, 5, 9]])).logits).all()


@pytest.mark.parametrize("family", ["gemma3_vlm", "llama4_vlm"])
def test_an_adapter_merged_offline_is_the_whole_composite_with_the_tower_carried(
    folders: dict[str, Path], tmp_path: Path, family: str
) -> None:
    """``hf-fsdp2 merge-adapter`` on a composite's adapter: the merged folder holds every tensor of the base under its
    name, the tower and projector byte-identical (the base's dtype), and loads with AutoModelForImageTextToText to
    base + adapter's logits. Llama 4 loads as its text model with AutoModelForCausalLM: the base class decides."""
    from safetensors import safe_open
    from support.composites import checkpoint_names

    from hf_fsdp2.lora.merge import merge_adapter_offline

    base = folders[family]
    model = apply_lora(_load(base), LoraSettings(r=4, alpha=8, dropout=0.0), seed=0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    model.save_pretrained(tmp_path / "adapter")
    merge_adapter_offline(tmp_path / "adapter", tmp_path / "merged", dtype="bfloat16")
    assert checkpoint_names(tmp_path / "merged") == checkpoint_names(base)
    spec = COMPOSITES[_ARCH[family]]
    with (
        safe_open(str(base / "model.safetensors"), "pt") as src,
        safe_open(str(tmp_path / "merged" / "model.safetensors"), "pt") as out,
    ):
        text = spec.language_model.removeprefix("model.")  # the hub's names: Gemma 3's language_model.model.*
        frozen = [k for k in checkpoint_names(base) if not k.startswith(text) and "lm_head" not in k]
        assert frozen
        for key in frozen:
            a, b = src.get_tensor(key), out.get_tensor(key)
            assert a.dtype == b.dtype and torch.equal(a, b), key
    merged = _load(tmp_path / "merged").eval()
    assert type(merged).__name__ == _ARCH[family]
    ids = torch.randint(3, 1000, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model.eval()(input_ids=ids).logits
        got = merged(input_ids=ids).logits
    assert float((got - want).abs().max()) <= 0.05 * float(want.abs().max())  # bf16 language model
