"""Worker for tests/distributed/test_perf_modes.py: each activation-checkpointing and compile mode, on
the same model and data, under FSDP2; reports losses, grad norms, the FSDP2 all-gather (unshard) and
prefetch sequence of each step, and the compile counters. Run under torchrun; rank 0 writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

from hf_fsdp2.config.plans import ACPlan, CompilePlan, ShardingPlan
from hf_fsdp2.model import decoder_layer_classes, load_model
from hf_fsdp2.parallel.accelerator import build_accelerator
from hf_fsdp2.parallel.compiling import CompileWatch
from hf_fsdp2.parallel.parallelize import ParallelPlan, parallelize
from hf_fsdp2.train.loss import LossPlan, causal_lm_loss_sum
from hf_fsdp2.train.optim import build_adamw, param_groups

EVENTS: list[str] = []


class _Backend(CompilePlan):
    """The run's compile plan with a configuration's backend (inductor unless the configuration names another)."""

    backend = "inductor"

    def kwargs(self) -> dict:
        return {**super().kwargs(), "backend": self.backend}


def _record_unshards() -> None:
    unshard, prefetch = FSDPParamGroup.unshard, FSDPParamGroup._prefetch_unshard

    def recorded_unshard(self, async_op: bool = False):  # type: ignore[no-untyped-def]
        EVENTS.append(f"unshard {self._module_fqn} {self._training_state.name}")
        return unshard(self, async_op)

    def recorded_prefetch(target, pass_type):  # type: ignore[no-untyped-def]
        EVENTS.append(f"prefetch {target._module_fqn} {pass_type}")
        return prefetch(target, pass_type)

    FSDPParamGroup.unshard = recorded_unshard  # type: ignore[method-assign]
    FSDPParamGroup._prefetch_unshard = staticmethod(recorded_prefetch)  # type: ignore[method-assign]


def run(acc, model_dir: str, ac: str, scope: str | None, steps: int, backend: str) -> dict:  # type: ignore[no-untyped-def]
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = load_model(model_dir)
    plan = ShardingPlan(activation_checkpointing=ACPlan(ac, every_k=2, pin_memory=False))
    _Backend.backend = backend
    compile_plan = _Backend(enabled=scope is not None, scope=scope or "regional")
    model = parallelize(
        model, acc, ParallelPlan(layer_cls=decoder_layer_classes(model), ac=plan.ac, compile=compile_plan)
    )
    opt = build_adamw(param_groups(model, 0.0), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, device_type="cpu")
    watch = CompileWatch(enabled=scope is not None).start()
    rank = acc.process_index
    out: dict = {"losses": [], "grad_norms": [], "events": [], "compile": []}
    for step in range(steps):
        ids = torch.randint(3, 1000, (2, 32), generator=torch.Generator().manual_seed(100 * step + rank))
        labels = ids.clone()
        labels[:, :5] = -100
        EVENTS.clear()
        loss = causal_lm_loss_sum(model, {"input_ids": ids}, labels, LossPlan(16))
        acc.backward(loss / 54)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        opt.step()
        opt.zero_grad()
        out["losses"].append(float(loss) / 54)
        out["grad_norms"].append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        out["events"].append(list(EVENTS))
        out["compile"].append(watch.take())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--configs",
        required=True,
        help="comma-separated ac:scope[:backend] items, scope eager|regional|model, backend inductor (default), "
        "aot_eager or eager",
    )
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    _record_unshards()
    acc = build_accelerator(ShardingPlan(), mixed_precision="no", compile_plan=CompilePlan())
    results = {}
    for item in args.configs.split(","):
        ac, scope, *backend = item.split(":")
        results[item] = run(
            acc,
            args.model,
            ac,
            None if scope == "eager" else scope,
            args.steps,
            backend[0] if backend else "inductor",
        )
    if acc.process_index == 0:
        Path(args.out).write_text(json.dumps(results))
    acc.end_training()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
