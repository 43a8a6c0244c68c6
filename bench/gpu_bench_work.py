"""gpu_bench.py's work: what every runner trains (the model, the packed rows, the optimizer settings) and
how a run is counted and timed (tokens, targets and FLOPs per batch, the throughput of the timed steps).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

SHAPES = {
    # Llama-3.2-1B
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256},
    # Llama-3.1-8B: fp32 masters + AdamW are 16 bytes a parameter (~120 GiB) at world size 1, so on one H200 it runs
    # only with activation checkpointing and short rows, if at all (an out-of-memory runner is reported as such)
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256},
    # a CPU-sized model with a real vocabulary (SmolLM2's size)
    "small": {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 49152},
    "tiny": {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 4096},
}  # fmt: skip
# AdamW's settings, the same in every runner (constant lr, no weight decay).
LR, BETAS, EPS = 1e-4, (0.9, 0.95), 1e-8


def matmul_peak(device: torch.device, n: int) -> float:
    """Achieved bf16 matmul FLOP/s on an n x n x n product (the best of a few timed runs)."""
    if device.type != "cuda":
        return float("nan")
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            a @ b
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / 10)
    return 2 * n**3 / best


def packed_batch(seq: int, vocab: int, step: int) -> dict[str, torch.Tensor]:
    """One packed row: documents of random lengths back to back, position_ids restarting per document."""
    g = torch.Generator().manual_seed(step)
    lengths: list[int] = []
    while sum(lengths) < seq:
        # at most half a row per document: every row holds several (the same attention path every step)
        longest = max(65, min(2048, seq // 2))
        lengths.append(min(int(torch.randint(64, longest, (1,), generator=g)), seq - sum(lengths)))
    ids = torch.randint(0, vocab, (1, seq), generator=g)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    labels = ids.clone()
    labels[position_ids == 0] = -100  # no target across a document boundary
    return {"input_ids": ids, "position_ids": position_ids, "labels": labels}


def trl_rows(seq: int, vocab: int, rows: int) -> dict[str, list[list[int]]]:
    """Rows ``0..rows-1`` of :func:`packed_batch` in the columns TRL's own packing produces: ``input_ids``
    and ``seq_lengths`` (its documents' lengths, from which TRL's collator rebuilds the position_ids)."""
    columns: dict[str, list[list[int]]] = {"input_ids": [], "seq_lengths": []}
    for step in range(rows):
        batch = packed_batch(seq, vocab, step)
        starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist()
        columns["input_ids"].append(batch["input_ids"][0].tolist())
        columns["seq_lengths"].append([b - a for a, b in zip(starts, [*starts[1:], seq], strict=True)])
    return columns


def llama_config(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig

    config = LlamaConfig(
        **SHAPES[args.shape],
        max_position_embeddings=max(args.seq, 8192),
        rope_theta=500000.0,
        tie_word_embeddings=True,
    )
    config._attn_implementation = "sdpa"
    return config


def build(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(llama_config(args))  # fp32 master weights; bf16 compute by the policy
    model.config.use_cache = False
    return model


def batch_counts(batch: dict[str, torch.Tensor], flops: Any) -> tuple[int, int, float]:
    """(non-pad tokens, target tokens, FLOPs) of a collated batch: the recipe's meter's own counting
    (``tokens_and_flops``: each document of a packed row at its own length, never ``T = seq``)."""
    from hf_fsdp2.observe.flops import tokens_and_flops
    from hf_fsdp2.train.loss import count_target_tokens

    # No pad id: the rows are documents back to back, without padding (TRL's collated rows neither).
    tokens, batch_flops = tokens_and_flops(batch, flops, pad_token_id=None)
    return tokens, count_target_tokens(batch["labels"]), batch_flops


def summarize(counts: list[tuple[int, int, float]], seconds: float) -> dict[str, float]:
    """Throughput of the timed steps: ``counts`` holds (tokens, targets, FLOPs) per timed step."""
    tokens, targets = sum(c[0] for c in counts), sum(c[1] for c in counts)
    return {
        "tokens_per_s": tokens / seconds,
        "target_tokens_per_s": targets / seconds,
        "step_s": seconds / len(counts),
        "tflops": sum(c[2] for c in counts) / seconds / 1e12,
        "timed_tokens": tokens,
        "timed_targets": targets,
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def max_mem_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
