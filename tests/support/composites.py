"""Tiny random-init composite checkpoints (a vision tower, a projector and a language model in one folder), saved as
the hub ships them: Gemma 3, Qwen3.5 dense and MoE, Llama 4, Mistral 3.

Each folder holds what a user downloads: the weights under the hub's tensor names (transformers' checkpoint
conversions applied on save, as from_pretrained reverts them: Gemma 3's ``vision_tower.vision_model.*``, Mistral 3's
``language_model.model.*``), Qwen3.5's multi-token-prediction tensors (``mtp.*``, which the class does not load),
config.json, generation_config.json, the cut Llama-2 test tokenizer with the family's image tokens as its last ids,
a chat template that takes text and image parts, and for Gemma 3 the processor (built in code; the other families'
image processors need torchvision, which the project does not install).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers
from conftest import CHATML_SPECIAL_TOKENS, CHATML_TEMPLATE, build_llama2_test_tokenizer

from support.families import _LINEAR_ATTENTION, _QWEN_MOE
from support.tiny import save_tokenizer

_TEXT: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=512,
)  # fmt: skip
_TOWER: dict[str, Any] = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8
)  # fmt: skip
_QWEN_TOWER: dict[str, Any] = dict(
    depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
    temporal_patch_size=2, out_hidden_size=64,
)  # fmt: skip
_QWEN_TOKENS = {
    "image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "vision_start_token": "<|vision_start|>",
    "vision_end_token": "<|vision_end|>",
}  # fmt: skip


def _gemma3(ids: dict[str, int]) -> dict[str, Any]:
    return dict(
        text_config=dict(_TEXT, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                         layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=30.0),
        vision_config=dict(_TOWER), mm_tokens_per_image=4, image_token_index=ids["image_token"],
        boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"], tie_word_embeddings=True,
    )  # fmt: skip


def _qwen3_5(ids: dict[str, int], *, moe: bool) -> dict[str, Any]:
    text = dict(_TEXT, head_dim=16, layer_types=["linear_attention", "full_attention"], **_LINEAR_ATTENTION)
    if moe:
        text.update(_QWEN_MOE)
    return dict(
        text_config=text, vision_config=dict(_QWEN_TOWER), image_token_id=ids["image_token"],
        video_token_id=ids["video_token"], vision_start_token_id=ids["vision_start_token"],
        vision_end_token_id=ids["vision_end_token"],
        # Dense tied only at the top level (as Qwen3.5's small checkpoints are): the composite ties, its text class
        # alone would not. MoE untied.
        tie_word_embeddings=not moe,
    )  # fmt: skip


def _llama4(ids: dict[str, int]) -> dict[str, Any]:
    return dict(
        text_config=dict(_TEXT, head_dim=16, intermediate_size=32, intermediate_size_mlp=128, num_local_experts=4,
                         num_experts_per_tok=1, interleave_moe_layer_step=2, no_rope_layers=[1, 0],
                         attention_chunk_size=8),
        vision_config=dict(_TOWER, vision_output_dim=64, projector_input_dim=64, projector_output_dim=64,
                           pixel_shuffle_ratio=0.5),
        image_token_index=ids["image_token"], boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"],
        tie_word_embeddings=False,
    )  # fmt: skip


def _mistral3(ids: dict[str, int]) -> dict[str, Any]:
    return dict(
        text_config=dict(_TEXT, model_type="mistral", head_dim=16, sliding_window=None),
        vision_config=dict(_TOWER, model_type="pixtral", head_dim=16),
        image_token_index=ids["image_token"], spatial_merge_size=2,
        tie_word_embeddings=False,  # Mistral3Config's default is True; Mistral Small 3.x is untied
    )  # fmt: skip


def _qwen_vl(ids: dict[str, int], *, v3: bool) -> dict[str, Any]:
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3] if v3 else [2, 2, 4]}
    if v3:
        rope["mrope_interleaved"] = True
    vision: dict[str, Any] = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=8,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=64,
    )
    if v3:
        vision.update(deepstack_visual_indexes=[0], num_position_embeddings=64)
    else:
        vision.update(fullatt_block_indexes=[1], window_size=16)
    return dict(
        text_config=dict(_TEXT, head_dim=16, rope_parameters=rope), vision_config=vision,
        image_token_id=ids["image_token"], video_token_id=ids["video_token"],
        vision_start_token_id=ids["vision_start_token"], vision_end_token_id=ids["vision_end_token"],
        tie_word_embeddings=v3,
    )  # fmt: skip


def _idefics3(ids: dict[str, int]) -> dict[str, Any]:
    return dict(
        text_config=dict(_TEXT, model_type="llama", head_dim=16), vision_config=dict(_TOWER), scale_factor=2,
        image_token_id=ids["image_token"], tie_word_embeddings=False,
    )  # fmt: skip


def _llava(ids: dict[str, int]) -> dict[str, Any]:
    return dict(
        text_config=dict(_TEXT, model_type="llama", head_dim=16), image_token_index=ids["image_token"],
        vision_config=dict(_TOWER, model_type="siglip_vision_model"), vision_feature_select_strategy="full",
        vision_feature_layer=-1, projector_hidden_act="gelu", tie_word_embeddings=False,
    )  # fmt: skip


# Idefics3's processor writes <fake_token_around_image>, <global-img> and a <row_r_col_c> tag per crop (up to 2 x 2
# here), special tokens as in SmolVLM's tokenizer.
_IDEFICS3_TOKENS = {"image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
                    "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>",
                    **{f"row_{r}_col_{c}": f"<row_{r}_col_{c}>" for r in (1, 2) for c in (1, 2)}}  # fmt: skip

# name -> (config class, the tokenizer's named image tokens, the config keys from those tokens' ids).
COMPOSITE_FAMILIES: dict[str, tuple[str, dict[str, str], Any]] = {
    "gemma3_vlm": (
        "Gemma3Config",
        {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
        _gemma3,
    ),
    "qwen3_5_vlm": ("Qwen3_5Config", _QWEN_TOKENS, lambda ids: _qwen3_5(ids, moe=False)),
    "qwen3_5_moe_vlm": ("Qwen3_5MoeConfig", _QWEN_TOKENS, lambda ids: _qwen3_5(ids, moe=True)),
    "llama4_vlm": (
        "Llama4Config",
        {"image_token": "<|image|>", "boi_token": "<|image_start|>", "eoi_token": "<|image_end|>"},
        _llama4,
    ),
    "mistral3": ("Mistral3Config", {"image_token": "[IMG]"}, _mistral3),
}
"""The composite fixtures the text family matrix trains, by family name (``make_composite_dir``'s ``family``)."""

VLM_ONLY: dict[str, tuple[str, dict[str, str], Any]] = {
    "qwen2_5_vl": ("Qwen2_5_VLConfig", _QWEN_TOKENS, lambda ids: _qwen_vl(ids, v3=False)),
    "qwen3_vl": ("Qwen3VLConfig", _QWEN_TOKENS, lambda ids: _qwen_vl(ids, v3=True)),
    "idefics3": ("Idefics3Config", _IDEFICS3_TOKENS, _idefics3),
    "llava": ("LlavaConfig", {"image_token": "<image>"}, _llava),
}
"""Composites trained on image records only in the tests (tests/distributed/test_vlm_2rank.py)."""

VLM_FAMILIES = ("gemma3_vlm", "qwen2_5_vl", "qwen3_vl", "qwen3_5_vlm", "idefics3", "llava")
"""The fixtures of the composites trained on image records (with :func:`vlm_processor`)."""
_ALL = {**COMPOSITE_FAMILIES, **VLM_ONLY}

# The dtype each fixture is saved in by default: one in bf16 (the default export_dtype), so that "the tower
# byte-identical" is tested where the export casts nothing, and the others in fp32, where it casts the language model.
FIXTURE_DTYPES: dict[str, torch.dtype] = {"mistral3": torch.bfloat16}

# Qwen3.5's checkpoints ship a multi-token-prediction head the class does not load (``_keys_to_ignore_on_load_
# unexpected``); the folder holds some of it, so an export that drops or renames what it does not load is seen.
MTP_TENSORS = {
    "mtp.fc.weight": (64, 128),
    "mtp.norm.weight": (64,),
    "mtp.pre_fc_norm_embedding.weight": (64,),
}

# ChatML with content that is a string or a list of parts (``{"type": "image"}``, ``{"type": "text", ...}``), the
# image part written as the family's image marker: the template shape of the hub's VLM checkpoints.
# An assistant turn's content and end of turn are in {% generation %} markers, which TRL's assistant-only loss reads.
_VLM_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ 'IMAGE_MARKER' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def composite_tokenizer(family: str) -> Any:
    """The cut Llama-2 test tokenizer (ChatML markers at 2096-2097) with ``family``'s named image tokens after them
    (``tokenizer.image_token``, ``.boi_token_id`` ... as hub tokenizers have them), pad = EOS, and a chat template
    that writes an image part as the family's image marker (Gemma 3: ``<start_of_image>``, which its processor
    expands)."""
    _, named, _ = _ALL[family]
    base = build_llama2_test_tokenizer(CHATML_TEMPLATE, CHATML_SPECIAL_TOKENS, small=True)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        extra_special_tokens=dict(named),
    )
    tokenizer.add_special_tokens({"extra_special_tokens": [*CHATML_SPECIAL_TOKENS, *named.values()]})
    tokenizer.pad_token = tokenizer.eos_token
    marker = named.get("boi_token") if family == "gemma3_vlm" else named["image_token"]
    if family in ("qwen3_5_vlm", "qwen3_5_moe_vlm", "qwen2_5_vl", "qwen3_vl"):
        marker = "<|vision_start|><|image_pad|><|vision_end|>"
    tokenizer.chat_template = _VLM_TEMPLATE.replace("IMAGE_MARKER", marker or "")
    return tokenizer


def _gemma3_processor(tokenizer: Any) -> Any:
    """Gemma 3's processor in code: the PIL image processor (no torchvision), 32-pixel images, 4 tokens each."""
    image_processor = transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    return transformers.Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_length=4,
        chat_template=tokenizer.chat_template,
    )


class _ImageOnly:
    """A Qwen processor without its video processor (which needs torchvision): what image records use of it."""

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)  # type: ignore[misc]


def vlm_processor(family: str, tokenizer: Any = None) -> Any:
    """``family``'s processor built in code (its PIL image processor: no torchvision) over ``tokenizer`` (default:
    :func:`composite_tokenizer`'s): 32-pixel tiles for Gemma 3, LLaVA and Idefics3 (4 tokens each for Gemma 3 and
    Idefics3, whose crops follow the image's size up to 2 x 2 plus the whole image), Qwen's 8-pixel patches merged 2 x 2
    at up to 64 x 64 pixels (4 to 16 tokens by the image's size)."""
    tokenizer = tokenizer if tokenizer is not None else composite_tokenizer(family)
    template = tokenizer.chat_template
    if family == "gemma3_vlm":
        return _gemma3_processor(tokenizer)
    if family in ("qwen2_5_vl", "qwen3_vl", "qwen3_5_vlm"):
        # Qwen3.5 ships Qwen3-VL's processor; its tiny tower's patches are 16 pixels (1 to 4 tokens an image).
        base = transformers.Qwen2_5_VLProcessor if family == "qwen2_5_vl" else transformers.Qwen3VLProcessor
        cls = type(base.__name__, (_ImageOnly, base), {})
        patch = 16 if family == "qwen3_5_vlm" else 8
        image_processor = transformers.Qwen2VLImageProcessorPil(
            patch_size=patch, merge_size=2, temporal_patch_size=2, min_pixels=4 * patch * patch,
            max_pixels=64 * patch * patch,
        )  # fmt: skip
        return cls(
            image_processor=image_processor, tokenizer=tokenizer, video_processor=None, chat_template=template
        )
    if family == "idefics3":
        image_processor = transformers.Idefics3ImageProcessorPil(
            size={"longest_edge": 64}, max_image_size={"longest_edge": 32}, do_image_splitting=True
        )
        return transformers.Idefics3Processor(
            image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4, chat_template=template
        )
    if family == "llava":
        image_processor = transformers.CLIPImageProcessorPil(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        )
        return transformers.LlavaProcessor(
            image_processor=image_processor, tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy="full",
            num_additional_image_tokens=0, chat_template=template,
        )  # fmt: skip
    raise ValueError(f"no processor fixture for {family!r}")


def save_vlm_processor(processor: Any, folder: Path) -> Path:
    """``processor`` (a code-built Qwen one, without a video processor) saved as a hub checkpoint lays it out: its
    image processor's ``preprocessor_config.json``, the tokenizer, ``processor_config.json``, ``chat_template.jinja``
    and the ``video_preprocessor_config.json`` that makes ``AutoProcessor`` load a torchvision video processor.
    (``save_pretrained`` of the processor itself cannot save a missing video processor.)"""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    processor.image_processor.save_pretrained(folder)
    processor.tokenizer.save_pretrained(folder)
    name = type(processor).__name__
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": name}))
    (folder / "chat_template.jinja").write_text(processor.chat_template)
    video = "Qwen2VLVideoProcessor" if name == "Qwen2_5_VLProcessor" else "Qwen3VLVideoProcessor"
    (folder / "video_preprocessor_config.json").write_text(
        json.dumps({"video_processor_type": video, "processor_class": name, "patch_size": 8, "merge_size": 2})
    )
    return folder


def _add_tensors(path: Path, extra: dict[str, tuple[int, ...]], dtype: torch.dtype, seed: int) -> None:
    """Append ``extra`` (random values) to the folder's single safetensors file, its metadata kept."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    file = path / "model.safetensors"
    with safe_open(str(file), "pt") as handle:
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        metadata = handle.metadata()
    gen = torch.Generator().manual_seed(seed + 7)
    for name, shape in extra.items():
        tensors[name] = (torch.randn(shape, generator=gen) * 0.02).to(dtype)
    save_file(tensors, str(file), metadata=metadata)


def composite_config(family: str, tokenizer: Any = None, overrides: dict[str, Any] | None = None) -> Any:
    """``family``'s tiny config (the one :func:`make_composite_dir` saves), its token ids from ``tokenizer``
    (default: :func:`composite_tokenizer`'s)."""
    cls, named, keys = _ALL[family]
    tokenizer = tokenizer if tokenizer is not None else composite_tokenizer(family)
    ids = {key: tokenizer.convert_tokens_to_ids(token) for key, token in named.items()}
    kwargs = keys(ids)
    kwargs["text_config"] = dict(
        kwargs["text_config"],
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    kwargs.update(overrides or {})
    config = getattr(transformers, cls)(**kwargs)
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    return config


def make_composite_dir(
    path: Path,
    family: str,
    *,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    processor: bool = True,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Save a tiny random-init composite of ``family`` to ``path`` as the hub ships it (see the module docstring).

    Args:
        path: the folder (created).
        family: a key of :data:`COMPOSITE_FAMILIES`.
        dtype: the weights' dtype on disk (config.json's ``dtype``); None: :data:`FIXTURE_DTYPES`'s (float32 but for
            the bf16 fixture).
        seed: torch seed of the initialisation.
        processor: also save Gemma 3's processor (processor_config.json); the first processor built in a process
            costs ~15 s of imports.
        overrides: top-level config values that replace the tiny defaults.

    Returns:
        ``path``.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    dtype = dtype or FIXTURE_DTYPES.get(family, torch.float32)
    tokenizer = composite_tokenizer(family)
    config = composite_config(family, tokenizer, overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[config.model_type])(config)
    for (
        param
    ) in model.parameters():  # parameters only: module.to(dtype) would cast Llama 4's complex rotary buffer
        param.data = param.data.to(dtype)
    model.config.dtype = dtype
    # A model built from its config saves under its module names; a hub checkpoint has the names from_pretrained
    # converts from (Gemma 3's vision_tower.vision_model.*, Mistral 3's language_model.model.*). Saving through the
    # class's whole conversion list writes those.
    model._weight_conversions = get_model_conversion_mapping(model, add_legacy=False)
    path.mkdir(parents=True, exist_ok=True)
    # generation_config.json as chat checkpoints ship it: generation stops at the end of a turn as well as at EOS.
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(CHATML_SPECIAL_TOKENS[1])],
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(path)
    if family in ("qwen3_5_vlm", "qwen3_5_moe_vlm"):
        _add_tensors(path, MTP_TENSORS, dtype, seed)
    if processor and family in (
        "gemma3_vlm",
        "idefics3",
        "llava",
    ):  # the Qwen processors need torchvision to load
        vlm_processor(family, tokenizer).save_pretrained(path)
    save_tokenizer(tokenizer, path)
    return path


def checkpoint_names(path: Path) -> list[str]:
    """The tensor names of the folder's safetensors files (headers only), sorted."""
    from safetensors import safe_open

    names: list[str] = []
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            names += list(handle.keys())
    return sorted(names)


def read_config(path: Path) -> dict[str, Any]:
    """The folder's config.json as a dict."""
    return dict(json.loads((path / "config.json").read_text()))
