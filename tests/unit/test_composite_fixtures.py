"""The composite fixtures (tests/support/composites.py) are what a user downloads: the hub's tensor names, Qwen3.5's
unloaded ``mtp.*`` tensors, the image tokens as the vocabulary's last ids, and a clean reload with the composite's
own class."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from support.composites import (
    COMPOSITE_FAMILIES,
    FIXTURE_DTYPES,
    MTP_TENSORS,
    checkpoint_names,
    make_composite_dir,
)

# A name of the hub's checkpoints that the module tree of a model built from config does not have (transformers
# converts it on load): saved under the module names, these fixtures would hide a loader that renames.
HUB_NAMES = {
    "gemma3_vlm": "vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight",
    "qwen3_5_vlm": "model.language_model.layers.0.linear_attn.in_proj_qkv.weight",
    "qwen3_5_moe_vlm": "model.language_model.layers.0.mlp.experts.0.gate_proj.weight",
    "llama4_vlm": "language_model.model.layers.0.self_attn.q_proj.weight",
    "mistral3": "language_model.model.layers.0.self_attn.q_proj.weight",
}


@pytest.mark.parametrize("family", list(COMPOSITE_FAMILIES))
def test_a_composite_fixture_is_saved_as_the_hub_ships_it(tmp_path: Path, family: str) -> None:
    folder = make_composite_dir(tmp_path / family, family, processor=False)
    names = checkpoint_names(folder)
    assert HUB_NAMES[family] in names, names[:10]
    assert any(n.startswith(("model.visual.", "vision_tower.", "vision_model.")) for n in names)
    mtp = [n for n in names if n.startswith("mtp.")]
    assert sorted(mtp) == (sorted(MTP_TENSORS) if family.startswith("qwen3_5") else [])
    config = json.loads((folder / "config.json").read_text())
    assert config["dtype"] == str(FIXTURE_DTYPES.get(family, torch.float32)).removeprefix("torch.")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert config["text_config"]["vocab_size"] == len(tokenizer)
    image = tokenizer.convert_tokens_to_ids(tokenizer.image_token)
    assert image >= len(tokenizer) - 4  # the image tokens are the last rows
    assert "<|im_end|>" in tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}], tokenize=False
    )
    generation = json.loads((folder / "generation_config.json").read_text())
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in generation["eos_token_id"]
    model, info = transformers.AutoModelForImageTextToText.from_pretrained(folder, output_loading_info=True)
    assert type(model).__name__ == config["architectures"][0]
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_the_gemma3_fixture_has_a_processor_that_expands_an_image(tmp_path: Path) -> None:
    from PIL import Image

    folder = make_composite_dir(tmp_path / "g", "gemma3_vlm")
    processor = transformers.AutoProcessor.from_pretrained(folder)
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}],
        tokenize=False,
    )
    batch = processor(text=[text], images=[Image.new("RGB", (40, 30), (255, 0, 0))], return_tensors="pt")
    image = processor.tokenizer.convert_tokens_to_ids(processor.tokenizer.image_token)
    assert int((batch["input_ids"] == image).sum()) == 4
    assert tuple(batch["pixel_values"].shape) == (1, 3, 32, 32)
