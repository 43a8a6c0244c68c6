"""The padding-free probe: whether a model's own masks keep the examples of a flattened row apart, decided by a
forward of a small random-init copy of it on the CPU (the config and the installed transformers alone, so every rank
decides the same). :mod:`hf_fsdp2.attention_layout` asks it before choosing padding-free batches or accepting rows of
several documents."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import PretrainedConfig

from hf_fsdp2.composite import auto_class

# Attention kernels that keep the examples of a flattened row apart by position_ids without a mask to build
# (varlen kernels); the others are checked by a probe forward.
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3")


def padding_free_matches(
    config: PretrainedConfig, attn_implementation: str = "auto", *, trust_remote_code: bool = False
) -> tuple[bool, str]:
    """Whether a padding-free batch (examples flattened into one row, ``position_ids`` restarting per example)
    gives this model the same logits as the padded batch, and why.

    Decided from the config alone, on CPU, deterministically (every rank decides the same): a random-init copy
    of the model with its first two layers and small MLP / vocabulary (the masking and attention code are the
    model's own) runs two examples padded and flattened; the logits of every real token must agree to fp32
    rounding. Varlen flash-attention kernels take ``position_ids`` by design and are not probed (they need a GPU).

    Returns:
        ``(matches, reason)``.
    """
    key = (config.to_json_string(use_diff=False), attn_implementation, trust_remote_code)
    if key not in _PROBED:  # the plan, the data and the model of a run ask the same: one probe per process
        _PROBED[key] = _probe_padding_free(config, attn_implementation, trust_remote_code)
    return _PROBED[key]


_PROBED: dict[tuple[str, str, bool], tuple[bool, str]] = {}


def _probe_padding_free(
    config: PretrainedConfig, attn_implementation: str, trust_remote_code: bool
) -> tuple[bool, str]:
    from hf_fsdp2.config.plans import PACKED_ATTENTION_IMPLEMENTATIONS

    if attn_implementation in VARLEN_ATTENTION:
        return True, f"{attn_implementation} separates the examples of a row by position_ids (varlen kernels)"
    if attn_implementation != "auto" and attn_implementation not in PACKED_ATTENTION_IMPLEMENTATIONS:
        return False, f"attn_implementation={attn_implementation} does not separate examples by position_ids"
    # Every step of the probe can meet a config it was not written for (a read-only attribute, a family whose
    # shrunk copy does not build, a forward that raises): any failure keeps padded batches, which every model
    # computes correctly, and says why. The failure depends on the config and this transformers alone, so every
    # rank fails alike and takes the same layout.
    stage = "shrink the config"
    state = torch.random.get_rng_state()
    try:
        small = _shrunk_config(config)
        stage = "build the model"
        kwargs: dict[str, Any] = {"dtype": torch.float32, "trust_remote_code": trust_remote_code}
        if attn_implementation != "auto":
            kwargs["attn_implementation"] = attn_implementation
        torch.manual_seed(0)
        model = auto_class(small).from_config(small, **kwargs)
        stage = "run its forward"
        diff, scale = _padded_against_flat(model)
    except Exception as err:
        return False, (
            f"{PROBE_FAILED} (it could not {stage} of {type(config).__name__}: {type(err).__name__}: {err}); "
            "padded batches kept"
        )
    finally:
        torch.random.set_rng_state(state)
    attn = getattr(model.config, "_attn_implementation", attn_implementation)
    if diff <= 1e-4 * scale:  # fp32 rounding of the same maths (a different mask gives O(1) differences)
        return (
            True,
            f"a probe forward with {attn} attention gives padded and padding-free batches the same logits",
        )
    return False, (
        f"with {attn} attention its padding-free logits differ from the padded ones by {diff:.3g} (scale "
        f"{scale:.3g}): this model's attention does not separate flattened examples"
    )


# The start of the reason when the probe itself failed (the layout then warns: a fallback is never silent).
PROBE_FAILED = "the padding-free probe failed"


def _shrunk_config(config: PretrainedConfig) -> PretrainedConfig:
    """A copy of ``config`` with its first two layers, a small MLP / vocabulary and sliding windows / attention chunks
    of 4 tokens (the masking and attention code stay the model's own). A per-layer list the config derives from
    ``num_hidden_layers`` (a read-only property, e.g. Falcon-H1's ``layers_block_type``) follows by itself and is
    left alone. A composite's language model is shrunk so (its text config), and its vision tower, which a text
    probe never runs but builds, to one block with a small MLP."""
    small = copy.deepcopy(config)
    text = small.get_text_config() if hasattr(small, "get_text_config") else small
    layers = min(2, int(getattr(text, "num_hidden_layers", 2) or 2))
    text.num_hidden_layers = layers
    for key in ("layer_types", "mlp_only_layers"):
        value = getattr(text, key, None)
        if isinstance(value, list) and len(value) != layers:
            setattr(text, key, value[:layers])
    for key in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if getattr(text, key, None):
            setattr(text, key, 32)
    for key in (
        "sliding_window",
        "attention_chunk_size",
    ):  # shorter than the examples: the windows and chunks cut
        if isinstance(getattr(text, key, None), int) and getattr(text, key) > 4:
            setattr(text, key, 4)
    text.vocab_size = 64
    for config_ in {id(text): text, id(small): small}.values():
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if isinstance(getattr(config_, key, None), int) and getattr(config_, key) >= 64:
                setattr(config_, key, 0)
    vision = getattr(small, "vision_config", None) if text is not small else None
    if vision is not None:
        for key in ("depth", "num_hidden_layers"):  # Qwen's towers name their blocks depth
            if isinstance(getattr(vision, key, None), int) and getattr(vision, key) > 1:
                setattr(vision, key, 1)
        for key in ("deepstack_visual_indexes", "fullatt_block_indexes"):  # block indexes past the one kept
            if isinstance(getattr(vision, key, None), list):
                setattr(vision, key, [i for i in getattr(vision, key) if i < 1])
        if getattr(vision, "intermediate_size", None):
            vision.intermediate_size = 32
    return small


def _padded_against_flat(model: torch.nn.Module) -> tuple[float, float]:
    """The largest difference between the logits of two examples run padded and flattened into one row, and the
    logits' scale."""
    model.eval()
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randint(3, 64, (5,), generator=gen), torch.randint(3, 64, (9,), generator=gen)
    ids = torch.zeros((2, 9), dtype=torch.long)
    mask = torch.zeros((2, 9), dtype=torch.long)
    ids[0, :5], mask[0, :5], ids[1], mask[1] = a, 1, b, 1
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        flat = model(
            input_ids=torch.cat([a, b])[None],
            position_ids=torch.cat([torch.arange(5), torch.arange(9)])[None],
            use_cache=False,
        ).logits
    want = torch.cat([padded[0, :5], padded[1]])
    return float((flat[0] - want).abs().max()), max(float(want.abs().max()), 1.0)
