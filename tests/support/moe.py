"""Tiny mixture-of-experts models for expert parallel's tests: 8 routed experts (top-2), two MoE layers, routing
skewed so that experts 6 and 7 never receive a token, and micro-batches whose lengths and target counts differ per
rank and per micro-batch.

The skew: every token embedding carries a common vector ``v`` (norm 1, far above the random rows), which the
residual stream keeps through both layers; the routers' rows of experts 6 and 7 point against it, so their logits sit
near ``-sqrt(hidden)``, while the other rows have no part along ``v`` (they route by what differs between tokens) and
their logits stay near 0: experts 6 and 7 are never in a token's top 2 (gpt-oss's router bias says the same). Under ``ep 4`` the ranks holding experts 6 and 7 then receive no token at all; under ``ep 2`` the rank
holding experts 4..7 receives tokens for two of its four.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from conftest import CHATML_SPECIAL_TOKENS, CHATML_TEMPLATE, build_llama2_test_tokenizer

from support.tiny import save_tokenizer

_COMMON: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=256, tie_word_embeddings=False,
)  # fmt: skip
EXPERTS = 8
IDLE = (6, 7)  # the experts no token is routed to

# name -> (config class, keys): router loss on for Qwen3-MoE, Qwen2-MoE and gpt-oss, off for Mixtral and OLMoE.
MOE_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 16, "num_experts": EXPERTS, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "output_router_logits": True,
                                     "router_aux_loss_coef": 0.1}),
    "mixtral": ("MixtralConfig", {"num_local_experts": EXPERTS, "num_experts_per_tok": 2,
                                  "output_router_logits": False}),
    # OLMoE: its head tied to the embedding (the root unit holds both; the other families' are untied).
    "olmoe": ("OlmoeConfig", {"num_experts": EXPERTS, "num_experts_per_tok": 2, "output_router_logits": False,
                              "tie_word_embeddings": True}),
    # Qwen2-MoE: a shared expert (and its sigmoid gate) beside the routed ones, dense on every rank.
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": EXPERTS, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 32, "output_router_logits": True,
                                     "router_aux_loss_coef": 0.1}),
    # gpt-oss: expert biases, interleaved gate/up, a router with a bias; sliding + full attention.
    "gpt_oss": ("GptOssConfig", {"head_dim": 16, "num_local_experts": EXPERTS, "num_experts_per_tok": 2,
                                 "intermediate_size": 32, "sliding_window": 8,
                                 "layer_types": ["sliding_attention", "full_attention"],
                                 "output_router_logits": True, "router_aux_loss_coef": 0.1}),
}  # fmt: skip


def _routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Each MoE layer's router: the module beside the experts whose weight has a row per expert."""
    out = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if (
            name.endswith((".gate", ".router"))
            and weight is not None
            and tuple(weight.shape)[:1] == (EXPERTS,)
        ):
            out.append(module)
    return out


def make_moe_dir(path: Path, family: str) -> Path:
    """Save the tiny skewed MoE of ``family`` with the Llama-2 test tokenizer; returns ``path``."""
    cls, extra = MOE_FAMILIES[family]
    tokenizer = build_llama2_test_tokenizer(CHATML_TEMPLATE, CHATML_SPECIAL_TOKENS, small=True)
    tokenizer.pad_token = tokenizer.eos_token
    config = getattr(transformers, cls)(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **{**_COMMON, **extra},
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        v = torch.randn(config.hidden_size, generator=torch.Generator().manual_seed(7))
        v /= v.norm()
        model.get_input_embeddings().weight += v
        routers = _routers(model)
        assert len(routers) == 2, f"{family}: routers {routers}"
        busy = [e for e in range(EXPERTS) if e not in IDLE]
        for router in routers:
            rows = (
                torch.randn(len(busy), config.hidden_size, generator=torch.Generator().manual_seed(8)) * 0.1
            )
            weight = router.weight
            assert isinstance(weight, torch.Tensor)
            weight[busy] = rows - (rows @ v)[:, None] * v  # no part along v: routed by the token alone
            weight[list(IDLE)] = -v
            bias = getattr(router, "bias", None)
            if bias is not None:
                bias[list(IDLE)] = -4.0
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    save_tokenizer(tokenizer, path)
    return path


STEPS = 4
LR = 2e-3
WORLD = 4


def moe_batches(step: int, rank: int) -> list[dict[str, torch.Tensor]]:
    """Rank ``rank``'s two micro-batches of ``step``: lengths, rows, padding and prompt lengths differ per rank and
    micro-batch, so every micro-batch has its own count of target tokens."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    shapes = ((1, 9 + 2 * rank), (2, 14 + 3 * rank)) if rank % 2 == 0 else ((2, 11 + rank), (1, 7 + 3 * rank))
    out = []
    for i, (rows, length) in enumerate(shapes):
        ids = torch.randint(3, 200, (rows, length), generator=gen)
        mask = torch.ones_like(ids)
        if rows == 2:
            mask[1, -(2 + rank) :] = 0
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, : 1 + (rank + i + step) % 4] = -100  # a prompt of 1..4 tokens: no loss there
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out
