"""Worker for tests/distributed/test_rollout.py: greedy generation on the FSDP2-sharded policy (gathered once per
rollout) against the same weights unsharded in this process, with a different number of prompts and of new tokens
on each rank; then a training step, to show the shards are back. Every rank writes ``<out>/rank<r>.json``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from hf_fsdp2.config.plans import CompilePlan, ShardingPlan
from hf_fsdp2.methods.grpo.rollout import SamplingSettings, TransformersGenerator
from hf_fsdp2.model import decoder_layer_classes, load_model, load_tokenizer
from hf_fsdp2.parallel.accelerator import build_accelerator
from hf_fsdp2.parallel.parallelize import ParallelPlan, parallelize
from hf_fsdp2.train.loss import cross_entropy_sum
from hf_fsdp2.train.optim import build_adamw, param_groups

# rank -> (prompts, new tokens): different batch sizes, prompt lengths and generation lengths per rank
WORK = {0: ([[5, 9, 14], [7, 8, 9, 10, 11, 12, 13]], 8), 1: ([[20, 21], [3, 4, 5, 6], [30]], 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gather", default="full")
    args = ap.parse_args()
    plan = ShardingPlan(activation_checkpointing=True)
    compile_plan = CompilePlan(enabled=False)
    acc = build_accelerator(plan, mixed_precision="no", compile_plan=compile_plan)
    rank = acc.process_index
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model)
    model = parallelize(
        model, acc, ParallelPlan(layer_cls=decoder_layer_classes(model), ac=plan.ac, compile=compile_plan)
    )
    opt = build_adamw(param_groups(model, 0.0), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, device_type="cpu")
    plain = load_model(args.model).eval()
    prompts, new_tokens = WORK[rank]
    settings = SamplingSettings(max_completion_length=new_tokens, do_sample=False, gather=args.gather)
    eos = [int(tokenizer.eos_token_id)]
    calls = {"all_gather": 0}
    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    originals = {n: getattr(dist, n) for n in names}

    def counting(name):  # type: ignore[no-untyped-def]
        def call(*a, **k):  # type: ignore[no-untyped-def]
            calls["all_gather"] += 1
            return originals[name](*a, **k)

        return call

    for n in names:  # FSDP2's all-gathers, whichever entry point this torch uses
        setattr(dist, n, counting(n))
    got = TransformersGenerator(
        model, pad_id=int(tokenizer.pad_token_id), eos_ids=eos, settings=settings
    ).generate(prompts, seed=0)
    for n in names:
        setattr(dist, n, originals[n])
    plain_settings = SamplingSettings(
        max_completion_length=new_tokens, do_sample=False
    )  # one process: no sync
    want = TransformersGenerator(
        plain, pad_id=int(tokenizer.pad_token_id), eos_ids=eos, settings=plain_settings
    ).generate(prompts, seed=0)
    units = sum(
        bool(m._get_fsdp_state()._fsdp_param_groups) for m in model.modules() if isinstance(m, FSDPModule)
    )
    sharded = all(
        p.to_local().numel() < p.numel()
        for p in model.parameters()
        if isinstance(p, DTensor) and p.numel() > 1
    )
    # A training step after the rollout: the same loss as the unsharded model, gradients on the shards.
    ids = torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(rank))
    model.train()
    loss = (
        cross_entropy_sum(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits, ids)
        / ids[:, 1:].numel()
    )
    with torch.no_grad():
        reference = (
            cross_entropy_sum(plain(input_ids=ids, attention_mask=torch.ones_like(ids)).logits, ids)
            / ids[:, 1:].numel()
        )
    acc.backward(loss)
    opt.step()
    report = {
        "got": got,
        "want": want,
        "all_gathers": calls["all_gather"],
        "units": units,
        "sharded_after": sharded,
        "loss": float(loss),
        "reference_loss": float(reference),
        "lengths": [len(c) for c in got],
    }
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
