"""Tiny random-init models of every family users fine-tune, built from their transformers configs, each
saved with a real tokenizer (the cut Llama-2 one of conftest.py, sized to the model's vocabulary)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from conftest import CHATML_SPECIAL_TOKENS, CHATML_TEMPLATE, build_llama2_test_tokenizer

from support.tiny import save_tokenizer

_COMMON: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=512,
)  # fmt: skip
_LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64, "rope_theta": 500000.0,
}  # fmt: skip

# name -> (config class, extra config keys). Head post-processing and MoE where the family has them.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama_tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "llama3_untied": ("LlamaConfig", {"tie_word_embeddings": False, "rope_parameters": _LLAMA3_ROPE}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}),
    "qwen3": ("Qwen3Config", {"head_dim": 16, "tie_word_embeddings": True}),
    "mistral": ("MistralConfig", {"head_dim": 16, "tie_word_embeddings": False}),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "final_logit_softcapping": 30.0}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "final_logit_softcapping": 30.0}),
    "phi3": ("Phi3Config", {"tie_word_embeddings": False}),
    "olmo2": ("Olmo2Config", {"tie_word_embeddings": False}),
    "granite": ("GraniteConfig", {"logits_scaling": 4.0, "tie_word_embeddings": True}),
    "gpt_neox": ("GPTNeoXConfig", {"tie_word_embeddings": False}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "output_router_logits": True,
            "router_aux_loss_coef": 0.01,
            "tie_word_embeddings": False,
        },
    ),  # fmt: skip
    "mixtral": (
        "MixtralConfig",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "output_router_logits": False,
            "tie_word_embeddings": False,
        },
    ),
}


def make_family_dir(
    path: Path,
    family: str,
    *,
    seed: int = 0,
    initializer_range: float | None = None,
    overrides: dict | None = None,
) -> Path:
    """Save a tiny random-init model of ``family`` with the Llama-2 tokenizer (ChatML template) to ``path``.

    Args:
        path: the folder (created).
        family: a key of :data:`FAMILIES`.
        seed: torch seed of the initialisation.
        initializer_range: std of the initial weights (large values give large logits).
        overrides: config values that replace the tiny defaults (e.g. wider layers).

    Returns:
        ``path``.
    """
    cls, extra = FAMILIES[family]
    tokenizer = build_llama2_test_tokenizer(CHATML_TEMPLATE, CHATML_SPECIAL_TOKENS, small=True)
    tokenizer.pad_token = tokenizer.eos_token
    kwargs = dict(_COMMON, **extra)
    kwargs.update(overrides or {})
    if initializer_range is not None:
        kwargs["initializer_range"] = initializer_range
    config = getattr(transformers, cls)(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **kwargs,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    save_tokenizer(tokenizer, path)
    return path


# The data of the family matrix: per step and rank, two micro-batches of very different sizes, so that
# one rank's micro-batch holds fewer target positions than CHUNK and another's more (the case where
# ranks once took different loss paths and deadlocked). Padded, with an attention mask.
CHUNK = 24
STEPS = 3
LR = 2e-3


def family_batches(step: int, rank: int) -> list[dict[str, torch.Tensor]]:
    """Rank ``rank``'s micro-batches of ``step``: [1 x 12] (11 targets) and [2 x 20] with 5 pads."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    out = []
    for rows, length in ((1, 12), (2, 20)) if rank % 2 == 0 else ((2, 20), (1, 12)):
        # Ids from 97 of the 2,098: a pattern the bf16 run learns in its 6 steps (loss from ~ln 2098 toward ln 97).
        ids = torch.randint(3, 100, (rows, length), generator=gen)
        mask = torch.ones_like(ids)
        if rows == 2:
            mask[1, -5:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :2] = -100  # a prompt: no loss on the first tokens
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out
