"""Worker for tests/distributed/test_lora_experts_ep.py: LoRA on the fused experts under expert parallel (every rank
holds whole experts, tokens exchanged), trained through the library's own step on 2 gloo ranks (``ep 2``), its adapter
exported and merged gather-free (not verified by the run: the test reloads both against its reference). Rank 0 writes
``<out>/<family>/result.json``. Run under torchrun.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch
from support.families import CHUNK, LR, STEPS, family_batches

from hf_fsdp2.config.plans import CompilePlan, LoraSettings, MeshPlan, ShardingPlan
from hf_fsdp2.export.reload_process import shared_reload_process
from hf_fsdp2.lora.adapter import apply_lora
from hf_fsdp2.lora.save import export_lora
from hf_fsdp2.model import decoder_layer_classes, load_model, load_tokenizer
from hf_fsdp2.parallel.accelerator import build_accelerator
from hf_fsdp2.parallel.expert_shard import expert_meshes
from hf_fsdp2.parallel.parallelize import ExpertParallel, ParallelPlan, parallelize
from hf_fsdp2.train.loss import plan_loss
from hf_fsdp2.train.optim import build_adamw, param_groups
from hf_fsdp2.train.step import StepSettings, train_step


def run_family(acc, meshes, family: str, model_dir: str, out: Path, parameters: list[str]) -> dict:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = load_model(model_dir)
    model = apply_lora(model, LoraSettings(r=4, alpha=8, dropout=0.0, target_parameters=parameters), seed=0)
    layers = decoder_layer_classes(model)
    model = parallelize(model, acc, ParallelPlan(layer_cls=layers, ep=ExpertParallel(meshes)))
    opt = build_adamw(param_groups(model, 0.0), lr=LR, betas=(0.9, 0.999), eps=1e-8, device_type="cpu")
    settings = StepSettings(plan_loss(model, CHUNK), max_grad_norm=1.0)
    losses, norms = [], []
    for step in range(STEPS):
        done = train_step(model, opt, None, family_batches(step, acc.process_index), settings, acc.device)
        losses.append(done.loss())
        norms.append(float(done.grad_norm))
    export_lora(
        model,
        out / "lora",
        base_model=model_dir,
        tokenizer=load_tokenizer(model_dir),
        merge=True,
        layer_cls_names=layers,
        mp_policy=acc.state.fsdp_plugin.mixed_precision_policy,
        dtype="float32",
        max_shard_bytes=10**9,
        compute_dtype=torch.float32,
        is_main_process=acc.is_main_process,
        experts=meshes,
        verify=False,
    )
    return {
        "losses": losses,
        "grad_norms": norms,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument(
        "--families", required=True, help="family:parameters (all-experts, or empty for all-linear's)"
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    acc = build_accelerator(ShardingPlan(), mixed_precision="no", compile_plan=CompilePlan(), timeout_s=300)
    meshes = expert_meshes(MeshPlan(dp_shard=acc.num_processes, ep=acc.num_processes), "cpu")
    for spec in args.families.split(","):
        family, _, targets = spec.partition(":")
        out = Path(args.out) / family
        try:
            result = run_family(
                acc, meshes, family, str(Path(args.root) / family), out, [t for t in [targets] if t]
            )
        except Exception as err:  # recorded per family: the test names the family that failed
            result = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
        if acc.is_main_process:
            out.mkdir(parents=True, exist_ok=True)
            (out / "result.json").write_text(json.dumps(result, indent=1))
    acc.end_training()


if __name__ == "__main__":
    with shared_reload_process():
        main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
