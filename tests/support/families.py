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

_LINEAR_ATTENTION = dict(
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_conv_kernel_dim=4,
)
_QWEN_MOE = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
)

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
    # The families of 2026, each with the layers that make it itself, two layers of different kinds where it mixes
    # them. Windows (8) and chunks (8) shorter than the family batches' 20-token rows, so they cut.
    # gpt-oss: attention sinks, MoE experts and router with biases, sliding/full, YaRN; router loss on.
    "gpt_oss": (
        "GptOssConfig",
        {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
         "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
         "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0},
         "output_router_logits": True, "router_aux_loss_coef": 0.01, "tie_word_embeddings": False},
    ),
    # Qwen3.5 (text model): gated-DeltaNet linear attention + gated full attention, partial rope.
    "qwen3_5": ("Qwen3_5TextConfig", {"head_dim": 16, "layer_types": ["linear_attention", "full_attention"],
                                      "tie_word_embeddings": True, **_LINEAR_ATTENTION}),
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        {"head_dim": 16, "layer_types": ["linear_attention", "full_attention"], "tie_word_embeddings": False,
         **_LINEAR_ATTENTION, **_QWEN_MOE},
    ),
    # Qwen3-Next: the same hybrid with a shared expert beside the routed ones.
    "qwen3_next": (
        "Qwen3NextConfig",
        {"head_dim": 16, "layer_types": ["linear_attention", "full_attention"], "tie_word_embeddings": False,
         **_LINEAR_ATTENTION, **_QWEN_MOE},
    ),
    # GLM-4.5: a dense first layer, then routed + shared experts (sigmoid router, group top-k), qk-norm.
    "glm4_moe": (
        "Glm4MoeConfig",
        {"head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "n_shared_experts": 1, "first_k_dense_replace": 1, "use_qk_norm": True, "tie_word_embeddings": False},
    ),
    # DeepSeek-V3: multi-head latent attention (low-rank q and kv), a dense first layer, routed + shared experts.
    "deepseek_v3": (
        "DeepseekV3Config",
        {"num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
         "qk_nope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1,
         "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 1, "moe_intermediate_size": 32,
         "tie_word_embeddings": False},
    ),
    # Falcon-H1: every layer attention and a Mamba-2 mixer side by side, muP multipliers.
    "falcon_h1": (
        "FalconH1Config",
        {"head_dim": 16, "mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_state": 16, "mamba_chunk_size": 16,
         "lm_head_multiplier": 0.5, "embedding_multiplier": 2.0, "tie_word_embeddings": False},
    ),
    # Granite 4 (-H): a Mamba-2 layer and an attention layer without rope, MoE beside a shared MLP.
    "granite4": (
        "GraniteMoeHybridConfig",
        {"layer_types": ["mamba", "attention"], "mamba_n_heads": 4, "mamba_d_state": 16, "mamba_chunk_size": 16,
         "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32, "shared_intermediate_size": 64,
         "position_embedding_type": "nope", "logits_scaling": 2.0, "tie_word_embeddings": True},
    ),
    # Llama 4 text: a chunked-attention rope layer (dense MLP) and a NoPE full-attention MoE layer.
    "llama4_text": (
        "Llama4TextConfig",
        {"head_dim": 16, "intermediate_size": 32, "intermediate_size_mlp": 128, "num_local_experts": 4,
         "num_experts_per_tok": 1, "interleave_moe_layer_step": 2, "no_rope_layers": [1, 0],
         "attention_chunk_size": 8, "tie_word_embeddings": False},
    ),
    # SmolLM3: a rope layer and a NoPE layer.
    "smollm3": ("SmolLM3Config", {"no_rope_layer_interval": 2, "tie_word_embeddings": True}),
    # OLMo 3 and EXAONE 4: sliding and full attention, norms after the blocks.
    "olmo3": ("Olmo3Config", {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                              "tie_word_embeddings": False}),
    "exaone4": ("Exaone4Config", {"head_dim": 16, "sliding_window": 8,
                                  "layer_types": ["sliding_attention", "full_attention"], "tie_word_embeddings": True}),
}  # fmt: skip


def family_config(family: str, tokenizer: Any, **overrides: Any) -> transformers.PretrainedConfig:
    """The tiny config of ``family`` (a key of :data:`FAMILIES`), its vocabulary and special ids ``tokenizer``'s,
    ``overrides`` replacing the tiny defaults."""
    cls, extra = FAMILIES[family]
    return getattr(transformers, cls)(  # type: ignore[no-any-return]
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **{**_COMMON, **extra, **overrides},
    )


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
    tokenizer = build_llama2_test_tokenizer(CHATML_TEMPLATE, CHATML_SPECIAL_TOKENS, small=True)
    tokenizer.pad_token = tokenizer.eos_token
    kwargs = dict(overrides or {})
    if initializer_range is not None:
        kwargs["initializer_range"] = initializer_range
    config = family_config(family, tokenizer, **kwargs)
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
