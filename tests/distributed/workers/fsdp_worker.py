"""Worker for tests/distributed/test_sharding.py: shard a tiny model, train a step, export; report JSON.

Run under torchrun; every rank writes ``<out>/rank<r>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from hf_fsdp2.config.plans import CompilePlan, ShardingPlan
from hf_fsdp2.export import export_model
from hf_fsdp2.model import decoder_layer_classes, load_model, load_tokenizer
from hf_fsdp2.parallel.accelerator import build_accelerator
from hf_fsdp2.parallel.parallelize import ParallelPlan, parallelize
from hf_fsdp2.train.loss import cross_entropy_sum
from hf_fsdp2.train.optim import build_adamw, param_groups


def gather_full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full weights (every rank takes part; rank 0 gets them): the test's reference only."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {
        k: v for k, v in get_model_state_dict(model, options=options).items() if isinstance(v, torch.Tensor)
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mixed_precision", default="bf16")
    ap.add_argument("--ac", action="store_true")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--ram_efficient", action="store_true")
    ap.add_argument("--export_dtype", default="bfloat16")
    ap.add_argument("--max_shard_bytes", type=int, default=10**9)
    args = ap.parse_args()
    out = Path(args.out)

    plan = ShardingPlan(activation_checkpointing=args.ac, cpu_ram_efficient_loading=args.ram_efficient)
    compile_plan = CompilePlan(enabled=args.compile)
    acc = build_accelerator(plan, mixed_precision=args.mixed_precision, compile_plan=compile_plan)
    rank = acc.process_index
    report: dict = {}
    reference = load_file(Path(args.model) / "model.safetensors")  # the checkpoint, read directly
    model = load_model(args.model, empty_weights=args.ram_efficient and rank != 0)
    report["meta_params_before_prepare"] = sum(p.is_meta for p in model.parameters())
    tokenizer = load_tokenizer(args.model)
    model = parallelize(
        model, acc, ParallelPlan(layer_cls=decoder_layer_classes(model), ac=plan.ac, compile=compile_plan)
    )
    opt = build_adamw(param_groups(model, 0.0), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, device_type="cpu")

    model_params = {id(p) for p in model.parameters()}
    opt_params = [p for g in opt.param_groups for p in g["params"]]
    report["optimizer_holds_model_params"] = len(opt_params) == len(model_params) and all(
        id(p) in model_params for p in opt_params
    )
    report.update({"distributed_type": str(acc.distributed_type), "world": acc.num_processes, "params": {}})
    for name, p in model.named_parameters():
        report["params"][name] = {
            "dtensor": isinstance(p, DTensor),
            "global": p.numel(),
            "local": p.to_local().numel() if isinstance(p, DTensor) else p.numel(),
            "dtype": str(p.dtype),
        }
    policy = acc.state.fsdp_plugin.mixed_precision_policy
    report["policy"] = {"param": str(policy.param_dtype), "reduce": str(policy.reduce_dtype)}
    report["model_class"] = type(model).__name__
    # Weights after sharding equal the checkpoint (rank 0's, broadcast when ram-efficient loading).
    full = gather_full_state_dict(model)
    if rank == 0:
        report["max_init_diff"] = max(
            float((full[k].float() - reference[k].float()).abs().max()) for k in full if k in reference
        )
        report["full_keys"] = sorted(full)

    ids = torch.randint(3, 1000, (2, 24), generator=torch.Generator().manual_seed(rank))
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    report["logits_dtype"] = str(logits.dtype)
    loss = cross_entropy_sum(logits, ids) / ids[:, 1:].numel()
    acc.backward(loss)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    report["grad_dtypes"] = sorted({str(g.dtype) for g in grads})
    report["grads_dtensor"] = all(isinstance(g, DTensor) for g in grads)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    report["grad_norm"] = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    opt.step()
    opt.zero_grad()

    trained = gather_full_state_dict(model)
    unwrapped = acc.unwrap_model(model)
    names = export_model(
        model,
        out / "export",
        config=unwrapped.config,
        tokenizer=tokenizer,
        generation_config=unwrapped.generation_config,
        dtype=args.export_dtype,
        max_shard_bytes=args.max_shard_bytes,
        compute_dtype=torch.bfloat16,
    ).files
    if rank == 0:
        torch.save(trained, out / "trained_fp32.pt")
        exported: dict[str, torch.Tensor] = {}
        for n in names:
            exported.update(load_file(out / "export" / n))
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.export_dtype]
        report["export_files"] = names
        report["export_keys"] = sorted(exported)
        report["export_dtypes"] = sorted({str(t.dtype) for t in exported.values()})
        report["export_equal"] = all(torch.equal(exported[k], trained[k].to(dtype)) for k in exported)
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    acc.end_training()


if __name__ == "__main__":
    main()
    # As recipes/sft.py does: skip interpreter finalization, where gloo's worker threads can abort
    # the process after a successful run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
