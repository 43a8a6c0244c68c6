"""2-rank emulated FP8 through the library's path (convert_float8 -> prepare_fsdp2 -> finish_float8): per step, the
FP8 model's loss against an fp32 reference at the same weights with the bound derived in
tests/distributed/test_float8.py, and the bytes FSDP2's all-gathers carry. Writes rank<r>.json to --out.

The FSDP2 policy is fp32 (mixed_precision no): the float8 casts are then the only difference from the reference.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hf_fsdp2.config.float8 import Float8Plan
from hf_fsdp2.config.plans import CompilePlan, ShardingPlan
from hf_fsdp2.model import decoder_layer_classes, load_model
from hf_fsdp2.parallel.accelerator import build_accelerator, prepare_fsdp2
from hf_fsdp2.parallel.float8 import convert_float8, finish_float8, float8_weight_names
from hf_fsdp2.train.optim import build_adamw, param_groups

# e4m3fn: 3 mantissa bits (round to nearest: relative error <= 2^-4 for normal values), largest 448, subnormal
# spacing 2^-9 (absolute error <= 2^-10 below the normal range). The fp32 products x*s and q/s add <= 2^-23.
U_E4M3 = 2.0**-4 + 2.0**-23
E4M3_MAX, E4M3_HALF_SUBNORMAL = 448.0, 2.0**-10


def cast_error(t: torch.Tensor) -> torch.Tensor:
    """Elementwise bound of |dequant(quant_e4m3(t)) - t| under one tensorwise scale s = 448 / amax(t)."""
    eta = float(t.abs().max()) / E4M3_MAX * E4M3_HALF_SUBNORMAL
    return U_E4M3 * t.abs() + eta


def plain(t: torch.Tensor) -> torch.Tensor:
    """A full (unsharded), plain fp32 copy of a parameter (torchao's float8-cast wrapper unwrapped)."""
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return getattr(full, "_tensor", full).detach().clone().float()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    acc = build_accelerator(ShardingPlan(), mixed_precision="no", compile_plan=CompilePlan())
    rank, world = acc.process_index, acc.num_processes
    model = load_model(args.model)
    reference = copy.deepcopy(model)  # unsharded fp32, this rank's own
    layer_cls = decoder_layer_classes(model)
    plan = Float8Plan(emulate=True)
    report = convert_float8(model, layer_cls, plan)
    opt = build_adamw(param_groups(model, 0.0), lr=3e-3, betas=(0.9, 0.999), eps=1e-8, device_type="cpu")
    model, opt = prepare_fsdp2(acc, model, opt, layer_cls)
    finish_float8(model, opt, plan, acc.device)
    float8_names = float8_weight_names(model)

    # Bytes this rank sends into FSDP2's all-gathers (torch calls dist.all_gather_single; every rank gathers).
    sent: list[tuple[str, int]] = []
    gather = dist.all_gather_single

    def counting(output_tensor, input_tensor, *a, **k):  # type: ignore[no-untyped-def]
        sent.append((str(input_tensor.dtype), input_tensor.numel() * input_tensor.element_size()))
        return gather(output_tensor, input_tensor, *a, **k)

    dist.all_gather_single = counting  # type: ignore[assignment]
    ref_linears = {name: reference.get_submodule(name) for name in report.converted}
    captured: dict[str, dict[str, torch.Tensor]] = {}

    def capture(name: str):  # type: ignore[no-untyped-def]
        def hook(mod: torch.nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            out.retain_grad()
            captured[name] = {"x": inputs[0].detach(), "w": mod.weight.detach(), "y": out}

        return hook

    for name, mod in ref_linears.items():
        mod.register_forward_hook(capture(name))
    # Each converted linear of the FP8 model against the exact product of its own input and the same weights:
    # |y_fp8 - x W^T| <= e(x) |W|^T + |x| e(W)^T + e(x) e(W)^T elementwise; the largest ratio to that bound is kept.
    ratios: dict[str, float] = {}

    def check_linear(name: str):  # type: ignore[no-untyped-def]
        def hook(mod: torch.nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            x, w = inputs[0].detach(), ref_linears[name].weight.detach()
            ex, ew = cast_error(x), cast_error(w)
            err = ex @ w.abs().T + x.abs() @ ew.T + ex @ ew.T
            ratios[name] = max(ratios.get(name, 0.0), float(((out.detach() - x @ w.T).abs() / err).max()))

        return hook

    for name in report.converted:
        model.get_submodule(name).register_forward_hook(check_linear(name))
    gen = torch.Generator().manual_seed(100 + rank)
    steps = []
    for _ in range(args.steps):
        ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=gen)
        # Every rank: the FP8 model's weights gathered, loaded into the reference.
        with torch.no_grad():
            full = {k: plain(v) for k, v in model.state_dict().items()}
        reference.load_state_dict(full)
        sent.clear()
        loss = model(input_ids=ids, labels=ids).loss
        forward_sent = list(sent)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_loss = reference(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        # First-order bound: |dL| <= sum over converted linears of sum(|dL/dy| * E), with E the elementwise bound of
        # |y_fp8 - y| = |x^ W^T - x W^T| <= e(x) |W|^T + |x| e(W)^T + e(x) e(W)^T.
        bound = 0.0
        for c in captured.values():
            x, w, g = c["x"], c["w"], c["y"].grad
            ex, ew = cast_error(x), cast_error(w)
            err = ex @ w.abs().T + x.abs() @ ew.T + ex @ ew.T
            bound += float((g.abs() * err).sum())
        reference.zero_grad(set_to_none=True)
        steps.append(
            {
                "loss": float(loss),
                "ref_loss": float(ref_loss),
                "bound": bound,
                "forward_sent": forward_sent,
                "linear_ratio": max(ratios.values()),
                "linear_ratio_min": min(ratios.values()),
            }
        )
        ratios.clear()
    expected = {"float8": 0, "other": 0}
    for name, param in model.named_parameters():
        key = "float8" if name in float8_names else "other"
        expected[key] += param.numel() // world * (1 if key == "float8" else 4)
    result = {
        "rank": rank,
        "world": world,
        "converted": report.converted,
        "float8_names": float8_names,
        "expected_bytes": expected,
        "steps": steps,
    }
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))
    acc.end_training()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
