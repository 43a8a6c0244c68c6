"""Worker for tests/distributed/test_verify_matrix.py: one run dtype, every export dtype, full / LoRA
adapter / merged, each exported with verification on after a training step. Rank 0 writes JSON reports.
Run under torchrun.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from hf_fsdp2.config.plans import CompilePlan, LoraSettings, ShardingPlan
from hf_fsdp2.export import export_model
from hf_fsdp2.export.reload_process import shared_reload_process
from hf_fsdp2.lora.adapter import apply_lora
from hf_fsdp2.lora.merge import build_merged_twin
from hf_fsdp2.lora.save import export_lora
from hf_fsdp2.model import decoder_layer_classes, load_model, load_tokenizer
from hf_fsdp2.parallel.accelerator import build_accelerator
from hf_fsdp2.parallel.parallelize import ParallelPlan, parallelize
from hf_fsdp2.train.loss import LossPlan
from hf_fsdp2.train.optim import build_adamw, param_groups
from hf_fsdp2.train.step import StepSettings, train_step


def trained(acc, model_dir: str, *, lora: bool, dtype: str):  # type: ignore[no-untyped-def]
    model = load_model(model_dir, dtype=dtype)
    if lora:
        model = apply_lora(model, LoraSettings(r=4, alpha=8, dropout=0.0), seed=0)
    layers = decoder_layer_classes(model)
    model = parallelize(model, acc, ParallelPlan(layer_cls=layers))
    opt = build_adamw(param_groups(model, 0.0), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, device_type="cpu")
    ids = torch.randint(3, 1000, (2, 24), generator=torch.Generator().manual_seed(acc.process_index))
    train_step(model, opt, None, [{"input_ids": ids, "labels": ids}], StepSettings(LossPlan(16)), acc.device)
    return model, layers


def report(result) -> dict:  # type: ignore[no-untyped-def]
    return {
        "ok": result.ok,
        "max_diff": result.max_logit_diff,
        "atol": result.atol,
        "scale": result.logit_scale,
        "reloaded": result.reloaded_tensors,
        "summary": result.summary(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mixed_precision", required=True)
    ap.add_argument("--load_dtype", default="float32")
    ap.add_argument("--dtypes", default="bfloat16,float32,float16,training")
    args = ap.parse_args()
    out = Path(args.out)
    acc = build_accelerator(ShardingPlan(), mixed_precision=args.mixed_precision, compile_plan=CompilePlan())
    compute = torch.bfloat16 if args.mixed_precision == "bf16" else None
    tokenizer = load_tokenizer(args.model)
    results: dict[str, dict] = {}
    model, _ = trained(acc, args.model, lora=False, dtype=args.load_dtype)
    for dtype in args.dtypes.split(","):
        result = export_model(
            model,
            out / f"full-{dtype}",
            config=model.config,
            tokenizer=tokenizer,
            generation_config=None,
            dtype=dtype,
            max_shard_bytes=300_000,
            compute_dtype=compute,
        )
        results[f"full-{dtype}"] = report(result.verify)
    del model
    lora, layers = trained(acc, args.model, lora=True, dtype=args.load_dtype)
    policy = acc.state.fsdp_plugin.mixed_precision_policy
    done = export_lora(
        lora,
        out / "lora",
        base_model=args.model,
        tokenizer=tokenizer,
        merge=False,
        layer_cls_names=layers,
        mp_policy=policy,
        dtype="bfloat16",
        max_shard_bytes=10**9,
        compute_dtype=compute or torch.float32,
        is_main_process=acc.is_main_process,
    )
    results["adapter"] = report(done.adapter_report)
    twin = build_merged_twin(lora, layer_cls_names=layers, mp_policy=policy)
    for dtype in args.dtypes.split(","):
        result = export_model(
            twin,
            out / f"merged-{dtype}",
            config=twin.config,
            tokenizer=tokenizer,
            generation_config=None,
            dtype=dtype,
            max_shard_bytes=10**9,
            compute_dtype=compute,
        )
        results[f"merged-{dtype}"] = report(result.verify)
    if acc.is_main_process:
        (out / "reports.json").write_text(json.dumps(results, indent=1))
    acc.end_training()


if __name__ == "__main__":
    with shared_reload_process():  # the exports are reloaded in one interpreter (not one each)
        main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
