"""Load a checkpoint on however many ranks this is launched with; dump the full model and optimizer state.

Used by tests/distributed/test_checkpoint.py to show that 2-rank and 1-rank loads agree exactly.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from hf_fsdp2.checkpoint.checkpointer import Checkpointer
from hf_fsdp2.config.plans import CompilePlan, ShardingPlan
from hf_fsdp2.model import decoder_layer_classes, load_model
from hf_fsdp2.parallel.accelerator import build_accelerator
from hf_fsdp2.parallel.parallelize import ParallelPlan, parallelize
from hf_fsdp2.train.optim import build_adamw, param_groups


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--dump", required=True)
    args = ap.parse_args()
    acc = build_accelerator(ShardingPlan(), mixed_precision="no", compile_plan=CompilePlan())
    model = load_model(args.model)
    model = parallelize(model, acc, ParallelPlan(layer_cls=decoder_layer_classes(model)))
    opt = build_adamw(param_groups(model, 0.0), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, device_type="cpu")
    ckpt = Checkpointer(
        Path(args.checkpoint).parent, keep_last=0, async_save=False, is_main_process=acc.is_main_process
    )
    ckpt.load(Path(args.checkpoint), model, opt)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=options)
    osd = get_optimizer_state_dict(model, opt, options=options)
    if acc.is_main_process:
        flat = {}
        for name, per_param in osd["state"].items():
            for key, value in per_param.items():
                flat[f"{name}.{key}"] = value
        torch.save({"model": msd, "optim": flat, "optim_keys": sorted(flat)}, args.dump)
    acc.end_training()


if __name__ == "__main__":
    main()
    # As recipes/sft.py does: skip interpreter finalization, where gloo's worker threads can abort
    # the process after a successful run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
