"""The vision tower's FSDP2 grain on published checkpoint shapes: what hf_fsdp2 chooses, and why.

    python bench/tower_grain.py

Each composite is built on the meta device (no weights, no hub) from a config written here with its published
sizes, in bf16, the language model trained and the tower frozen (the default) or trained. Per row: the tower as one
unit (GiB), its blocks and the rest, the largest decoder layer, the peak of unsharded parameters around the tower
and the decoder layers as one unit and per block (``hf_fsdp2.vision.grain.peak_unsharded``, the formula
tests/distributed/test_vlm_2rank.py holds to the measured peaks), the all-gathers of the tower per micro-batch and their bytes, and
the grain the library takes. Prints a Markdown table (docs/vlm.md).
"""

from __future__ import annotations

from typing import Any

import torch
import transformers

from hf_fsdp2.composite import composite_spec, model_class
from hf_fsdp2.model import decoder_layer_classes
from hf_fsdp2.vision.grain import choose_grain, peak_unsharded, tower_gather_bytes, tower_gathers, tower_sizes

GIB = 2**30
_SIGLIP_400M = dict(
    hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16, patch_size=14
)


def _gemma3(hidden: int, inter: int, layers: int, heads: int, kv: int, head_dim: int) -> Any:
    text = dict(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=head_dim, vocab_size=262208,
    )  # fmt: skip
    return transformers.Gemma3Config(
        text_config=text, vision_config=dict(_SIGLIP_400M, image_size=896), mm_tokens_per_image=256
    )


def _qwen2_5_vl(hidden: int, inter: int, layers: int, heads: int, kv: int) -> Any:
    text = dict(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, vocab_size=152064,
    )  # fmt: skip
    vision = dict(
        depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14, out_hidden_size=hidden,
        fullatt_block_indexes=[7, 15, 23, 31], window_size=112,
    )  # fmt: skip
    return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision)


def _smolvlm_256m() -> Any:
    text = dict(
        model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49280,
    )  # fmt: skip
    vision = dict(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, patch_size=16,
        image_size=512,
    )  # fmt: skip
    return transformers.Idefics3Config(text_config=text, vision_config=vision, scale_factor=4)


SHAPES = {
    "Gemma 3 4B": lambda: _gemma3(2560, 10240, 34, 8, 4, 256),
    "Gemma 3 12B": lambda: _gemma3(3840, 15360, 48, 16, 8, 256),
    "Gemma 3 27B": lambda: _gemma3(5376, 21504, 62, 32, 16, 128),
    "Qwen2.5-VL 3B": lambda: _qwen2_5_vl(2048, 11008, 36, 16, 2),
    "Qwen2.5-VL 7B": lambda: _qwen2_5_vl(3584, 18944, 28, 28, 4),
    "Qwen2.5-VL 72B": lambda: _qwen2_5_vl(8192, 29568, 80, 64, 8),
    "SmolVLM 256M": _smolvlm_256m,
}


def main() -> None:
    print(
        "| checkpoint shape | tower | tower GiB (blocks x GiB + rest) | decoder layer GiB | peak as one unit | "
        "peak per block | the tower's all-gathers per micro-batch | their GiB | grain |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, build in SHAPES.items():
        config = build()
        config.architectures = [model_class(config).__name__]
        with torch.device("meta"):
            model = model_class(config)._from_config(config, dtype=torch.bfloat16)
        spec = composite_spec(config)
        assert spec is not None
        for trained in (False, True):
            model.requires_grad_(False)
            for key, param in model.named_parameters():
                param.requires_grad_(
                    key.startswith(spec.language_model) or (trained and key.startswith(spec.tower))
                )
            s = tower_sizes(model, spec, decoder_layer_classes(model))
            grain = choose_grain(s)
            print(
                f"| {name} | {'trained' if trained else 'frozen'} | {s.tower / GIB:.2f} ({s.blocks} x "
                f"{s.block / GIB:.3f} + {s.rest / GIB:.3f}) | {s.layer / GIB:.3f} | "
                f"{peak_unsharded(s, 'tower') / GIB:.2f} | {peak_unsharded(s, 'blocks') / GIB:.2f} | "
                f"{tower_gathers(s, 'tower')} -> {tower_gathers(s, 'blocks')} | "
                f"{tower_gather_bytes(s, 'tower') / GIB:.2f} -> {tower_gather_bytes(s, 'blocks') / GIB:.2f} | "
                f"{'per block' if grain == 'blocks' else 'one unit'} |"
            )


if __name__ == "__main__":
    main()
