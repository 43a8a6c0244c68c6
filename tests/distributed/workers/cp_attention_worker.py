"""Worker for tests/distributed/test_context_parallel.py: the all-to-all context-parallel attention gives each rank
exactly its part of the whole-sequence model, in fp64, on every family and kernel listed, for cp = world (4) and for
two cp groups of 2 that hold different batches. The loss summed over a group equals the whole batch's; the
gradients summed over a group equal the whole batch's. Rank 0 writes ``<out>/result.json``.

The flash case runs transformers' own flash code with a stand-in for flash-attn (tests/support/fake_flash.py)
against the whole model under sdpa (its block-diagonal mask from the positions): two rows of different documents,
which the flash path keeps apart only when it is handed their boundaries.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import transformers
from support.fake_flash import StandInFlash

from hf_fsdp2.parallel.all_to_all import enable_context_parallel, shard_sequence, whole_sequences
from hf_fsdp2.train.loss import LossPlan, causal_lm_loss, count_target_tokens

SMALL = dict(
    vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=256
)
# (name, config class, extra keys, attention kernel, packed rows): heads 4 and KV heads 2 unless said.
CASES = [
    (
        "llama_gqa_sdpa_packed",
        "LlamaConfig",
        {"num_attention_heads": 4, "num_key_value_heads": 2},
        "sdpa",
        True,
    ),
    (
        "llama_eager_padded",
        "LlamaConfig",
        {"num_attention_heads": 4, "num_key_value_heads": 2},
        "eager",
        False,
    ),
    # One KV head: repeated to cp before the all-to-all.
    (
        "qwen3_one_kv_head_packed",
        "Qwen3Config",
        {"num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16},
        "sdpa",
        True,
    ),
    # Sliding window (5 < the documents) and soft-capped attention logits, in the family's own eager kernel.
    (
        "gemma2_sliding_softcap_packed",
        "Gemma2Config",
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "sliding_window": 5,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
        },
        "eager",
        True,
    ),
    # Rows of several documents under a flash kernel: the all-to-all hands it every document's boundaries.
    (
        "llama_gqa_flash_packed",
        "LlamaConfig",
        {"num_attention_heads": 4, "num_key_value_heads": 2},
        "flash_attention_2",
        True,
    ),
    (
        "mixtral_moe_sdpa_padded",
        "MixtralConfig",
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
        },
        "sdpa",
        False,
    ),
]


# Packed rows under sdpa, and Gemma2's sliding window and soft-capped logits under its eager kernel.
BLOCK_CASES = ("llama_gqa_sdpa_packed", "gemma2_sliding_softcap_packed")


def batch(seed: int, packed: bool) -> dict[str, torch.Tensor]:
    """Two rows of 23 tokens (not a multiple of 2 or 4: parts are padded); packed: documents of 9, 8 and 6 tokens,
    then of 4, 12 and 7; padded: the second row right-padded after 15 tokens. Labels mask each row's first 3 tokens."""
    g = torch.Generator().manual_seed(seed)
    rows, width = 2, 23
    ids = torch.randint(0, SMALL["vocab_size"], (rows, width), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    if packed:
        positions = torch.stack(
            [torch.cat([torch.arange(n) for n in lengths]) for lengths in ([9, 8, 6], [4, 12, 7])]
        )
        return {"input_ids": ids, "labels": labels, "position_ids": positions}
    mask = torch.ones(rows, width, dtype=torch.long)
    mask[1, 15:] = 0
    labels[1, 15:] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


@contextlib.contextmanager
def recorded_masks(masks: list[dict], block: bool) -> Iterator[None]:
    """Every mask the layers build recorded (kind, the bytes its tensors hold, the formula's); ``block``: the CUDA
    path on CPU, cp_attention takes flex attention's block mask (torch's check that refuses flex's backward on CPU is
    lifted, so its unfused math implementation runs, forward and backward)."""
    from torch.nn.attention import flex_attention as torch_flex

    from hf_fsdp2.parallel import all_to_all, block_mask

    def built(documents, length, window, rows, device):  # type: ignore[no-untyped-def]
        mask = block_mask.build_block_mask(documents, length, window, rows, device)
        held = sum(t.nbytes for t in mask.as_tuple() if isinstance(t, torch.Tensor))
        held += documents.nbytes if documents is not None else 0
        formula = block_mask.block_mask_bytes(rows, length, documents is not None)
        masks.append({"kind": "block", "bytes": held, "formula": formula})
        return mask

    def dense(*args, **kwargs):  # type: ignore[no-untyped-def]
        allowed = all_to_all_pairs(*args, **kwargs)
        masks.append({"kind": "dense", "bytes": allowed.nbytes, "shape": list(allowed.shape)})
        return allowed

    all_to_all_pairs = all_to_all.allowed_pairs
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(all_to_all, "build_block_mask", built))
        stack.enter_context(mock.patch.object(all_to_all, "allowed_pairs", dense))
        if block:
            stack.enter_context(mock.patch.object(all_to_all, "flex_trains_on", lambda device_type: True))
            stack.enter_context(mock.patch.object(torch_flex, "_validate_device", lambda *tensors: None))
        yield


def check(
    case: tuple,
    group: dist.ProcessGroup,
    cp: int,
    index: int,
    seed: int,
    flash: StandInFlash,
    block: bool = False,
) -> dict:
    name, cls, extra, kernel, packed = case
    config = getattr(transformers, cls)(**SMALL, **extra)
    torch.manual_seed(0)
    # fp64, but MoE experts in fp32: torch's grouped_mm (transformers' experts kernel) has no fp64.
    dtype = torch.float32 if "moe" in name else torch.float64
    # A flash kernel: both built with sdpa (loading flash would look for flash-attn), the parts then run flash.
    # Each model its own config (from_config keeps the object given): the parts' kernel is theirs alone.
    loaded = "sdpa" if kernel.startswith("flash") else kernel
    whole = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=loaded).to(dtype)
    part = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(config), attn_implementation=loaded
    ).to(dtype)
    part.load_state_dict(whole.state_dict())
    part.config._attn_implementation = kernel
    data = batch(seed, packed)
    plan = LossPlan()
    want = causal_lm_loss(
        whole, {k: v for k, v in data.items() if k != "labels"}, data["labels"], plan
    ).ce_sum
    tokens = count_target_tokens(data["labels"])
    (want / tokens).backward()
    line = enable_context_parallel(part, group, cp)
    mine = shard_sequence(data, cp, index)
    flash.calls.clear()
    masks: list[dict] = []
    with recorded_masks(masks, block):
        got = causal_lm_loss(
            part, {k: v for k, v in mine.items() if k != "labels"}, mine["labels"], plan
        ).ce_sum
        counts = torch.tensor([count_target_tokens(mine["labels"])])
        dist.all_reduce(counts, group=group)
        (got / tokens).backward()
    calls = list(flash.calls)
    loss = got.detach().clone()
    dist.all_reduce(loss, group=group)
    worst = 0.0
    for p, q in zip(part.parameters(), whole.parameters(), strict=True):
        grad = p.grad.clone()
        dist.all_reduce(grad, group=group)
        worst = max(worst, float((grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-300)))
    # Whole sequences on every rank (eval samples): the model's own kernel, no all-to-all.
    with torch.no_grad(), whole_sequences(part):
        same = part(input_ids=data["input_ids"][:1, :9]).logits
        whole.config._attn_implementation = kernel
        ref = whole(input_ids=data["input_ids"][:1, :9]).logits
    return {
        "flash_kinds": sorted({c.kind for c in calls}),
        "cu_seqlens": sorted({c.cu_seqlens for c in calls if c.cu_seqlens is not None}),
        "line": line,
        "tokens": [int(counts), tokens],
        "loss": [float(loss), float(want)],
        "grad_rel": worst,
        "whole_sequences_diff": float((same - ref).abs().max()),
        "dtype": str(dtype),
        "masks": masks,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    results: dict = {}
    try:
        with StandInFlash().installed() as flash:
            for case in CASES:
                # cp = world: one group, one batch; cp = 2: two groups with different batches (seed by group).
                results[f"{case[0]}/cp{world}"] = check(case, dist.group.WORLD, world, rank, 0, flash)
                results[f"{case[0]}/cp2"] = check(case, pairs[rank // 2], 2, rank % 2, 1 + rank // 2, flash)
                if (
                    case[0] in BLOCK_CASES
                ):  # the same, the documents and window as flex attention's block mask
                    results[f"{case[0]}/cp2/block"] = check(
                        case, pairs[rank // 2], 2, rank % 2, 1 + rank // 2, flash, block=True
                    )
    except Exception:  # noqa: BLE001 - reported to the test
        results["error"] = traceback.format_exc()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "result.json").write_text(json.dumps(gathered, indent=1))
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
