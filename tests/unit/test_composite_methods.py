"""The methods on composite checkpoints (vision tower + projector + language model): what a method cannot serve is
refused at its start-up checks (``Method.objective(cfg)``, the loop's first call, before the session, the data and
any weight), naming the architecture, why and the fix; what it serves passes them."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.composites import make_composite_dir
from support.tiny import make_tiny_llama_dir

from hf_fsdp2.config import ConfigError
from hf_fsdp2.methods import parse_method_config
from hf_fsdp2.run.registry import get_method


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("composite_methods")
    out = {
        f: make_composite_dir(root / f, f, processor=False)
        for f in ("gemma3_vlm", "qwen3_5_vlm", "qwen3_5_moe_vlm", "llama4_vlm", "mistral3")
    }
    out["llama"] = make_tiny_llama_dir(root / "llama")
    return out


def _objective(method: str, folder: Path, *args: str) -> object:
    cfg = parse_method_config(
        method,
        ["--model_name_or_path", str(folder), "--dataset_name", "data.jsonl", "--output_dir", "out", *args],
    )
    return get_method(method).objective(cfg)


GRPO = ("--reward_funcs", "exact_match")


@pytest.mark.parametrize(
    ("family", "architecture"),
    [
        ("llama4_vlm", "Llama4ForConditionalGeneration"),
        ("mistral3", "Mistral3ForConditionalGeneration"),
        ("qwen3_5_moe_vlm", "Qwen3_5MoeForConditionalGeneration"),
    ],
)
def test_a_reward_model_of_a_composite_without_a_classification_class_is_refused_by_name(
    folders: dict[str, Path], family: str, architecture: str
) -> None:
    with pytest.raises(ConfigError) as err:
        _objective("rm", folders[family])
    text = str(err.value)
    assert f"reward modelling on {architecture}" in text
    assert "has no sequence-classification class for this composite" in text
    assert "Gemma3ForConditionalGeneration, Qwen3_5ForConditionalGeneration" in text  # the ones that have one


@pytest.mark.parametrize("family", ["gemma3_vlm", "qwen3_5_vlm", "llama"])
def test_a_reward_model_of_a_family_with_a_classification_class_passes_the_checks(
    folders: dict[str, Path], family: str
) -> None:
    assert _objective("rm", folders[family]) is not None


@pytest.mark.parametrize("mode", ["server", "colocate"])
@pytest.mark.parametrize("family", ["gemma3_vlm", "llama4_vlm"])
def test_grpo_with_vllm_on_a_composite_is_refused_by_name(
    folders: dict[str, Path], family: str, mode: str
) -> None:
    with pytest.raises(
        ConfigError, match=r"use_vllm=true \(vllm_mode " + mode + r"\) on \w+ForConditionalGeneration"
    ):
        _objective("grpo", folders[family], *GRPO, "--use_vllm", "true", "--vllm_mode", mode)


@pytest.mark.parametrize("family", ["gemma3_vlm", "llama"])
def test_grpo_without_vllm_on_a_composite_passes_the_checks(folders: dict[str, Path], family: str) -> None:
    assert _objective("grpo", folders[family], *GRPO) is not None


@pytest.mark.parametrize(
    ("family", "reward_class"),
    [("gemma3_vlm", "Gemma3ForSequenceClassification"), ("qwen3_5_vlm", "Qwen3_5ForSequenceClassification")],
)
def test_a_reward_model_over_a_composite_is_that_composites_row(
    folders: dict[str, Path], family: str, reward_class: str
) -> None:
    """transformers' class puts the score head on the whole composite: the run freezes its tower and projector, makes
    them FSDP2 units and leaves them out of LoRA, as for the composite itself (this class's config names it)."""
    import dataclasses

    import transformers

    from hf_fsdp2.composite import composite_spec, partition
    from hf_fsdp2.config.plans import LoraSettings
    from hf_fsdp2.lora.adapter import apply_lora
    from hf_fsdp2.model import load_model

    model = load_model(str(folders[family]), reward_head=2)
    assert type(model).__name__ == reward_class and model.config.architectures == [reward_class]
    spec = composite_spec(model.config)
    assert (
        spec is not None
        and spec.architecture == transformers.AutoConfig.from_pretrained(folders[family]).architectures[0]
    )
    assert partition(model, spec)["head"] == ["score.weight"]
    settings = dataclasses.replace(LoraSettings(r=4, alpha=8, dropout=0.0), task_type="SEQ_CLS")
    wrapped = apply_lora(model, settings, seed=0)
    adapted = {
        n.removeprefix("base_model.model.") for n, m in wrapped.named_modules() if hasattr(m, "lora_A")
    }
    assert adapted and all(n.startswith(spec.language_model + ".") for n in adapted), sorted(adapted)
