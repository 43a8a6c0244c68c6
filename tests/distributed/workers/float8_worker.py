"""2-rank emulated FP8 through the library's path (convert_float8 -> parallelize -> finish_float8): per step, the
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
from hf_fsdp2.parallel.accelerator import build_accelerator
from hf_fsdp2.parallel.float8 import convert_float8, finish_float8, float8_weight_names
from hf_fsdp2.parallel.float8_bound import Float8BoundProbe
from hf_fsdp2.parallel.parallelize import ParallelPlan, parallelize
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


# Deliberately broken FP8 forwards, each a bug the run-time loss bound must catch (test_float8.py), compared on
# BROKEN_BATCHES batches each (with random tokens a bug moves the loss by a sum of random signs too: one batch can
# land inside the bound by chance, several cannot):
# "none": the control, the FP8 forward as it is (must pass on every batch);
# "scale:0.25": FSDP2's float8 all-gather hands the dequantisation a weight scale 4x too small (a scale off by a
#               factor: every float8 weight comes back 4x itself);
# "stale:16": each input cast with the scale of an amax 16x too small (a stale amax): its larger values clip at 448.
MUTATIONS = ("none", "scale:0.25", "stale:16")
BROKEN_BATCHES = 4


def _patch(mutation: str) -> list[tuple[object, str, object]]:
    """Apply ``mutation`` to torchao's float8 casts; returns what to restore."""
    import torchao.float8.float8_linear as f8_linear
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8
    from torchao.float8.float8_utils import tensor_to_scale
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    kind, _, factor_text = mutation.partition(":")
    factor = float(factor_text or 1)
    if kind == "scale":
        original = WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather

        def pre_all_gather(self, mesh):  # type: ignore[no-untyped-def]
            data, (scale,) = original(self, mesh)
            return data, (scale * factor,)

        WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather = pre_all_gather  # type: ignore[method-assign]
        return [(WeightWithDynamicFloat8CastTensor, "fsdp_pre_all_gather", original)]
    if kind == "stale":

        def cast(hp, dtype, mm_config, *a, gemm_input_role=GemmInputRole.INPUT, **k):  # type: ignore[no-untyped-def]
            if gemm_input_role is not GemmInputRole.INPUT:
                return hp_tensor_to_float8_dynamic(
                    hp, dtype, mm_config, *a, gemm_input_role=gemm_input_role, **k
                )
            scale = tensor_to_scale(hp, dtype) * factor
            return hp_tensor_and_scale_to_float8(hp, scale, dtype, mm_config, gemm_input_role)

        f8_linear.hp_tensor_to_float8_dynamic = cast  # type: ignore[assignment]
        return [(f8_linear, "hp_tensor_to_float8_dynamic", hp_tensor_to_float8_dynamic)]
    return []


def break_and_compare(
    mutation: str,
    model: torch.nn.Module,
    reference: torch.nn.Module,
    probe: Float8BoundProbe,
    gen: torch.Generator,
) -> dict:
    """The FP8 model's loss with ``mutation`` applied against the reference at the same weights, and the bound, on
    BROKEN_BATCHES batches."""
    with torch.no_grad():
        reference.load_state_dict({k: plain(v) for k, v in model.state_dict().items()})
    rows = []
    for _ in range(BROKEN_BATCHES):
        ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=gen)
        with probe:
            ref_loss = reference(input_ids=ids, labels=ids).loss
            ref_loss.backward()
        bound = probe.result()
        reference.zero_grad(set_to_none=True)
        restore = _patch(mutation)
        try:
            with torch.no_grad():
                loss = float(model(input_ids=ids, labels=ids).loss)
        finally:
            for owner, name, value in restore:
                setattr(owner, name, value)
        rows.append({"loss": loss, "ref_loss": float(ref_loss), "bound": bound.bound, "worst": bound.worst})
    return {"mutation": mutation, "batches": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--broken", action="store_true", help="after the steps, the deliberately broken FP8 forwards"
    )
    ap.add_argument(
        "--weight-scale", type=float, default=1.0, help="multiply the loaded matrices (see the test)"
    )
    args = ap.parse_args()
    acc = build_accelerator(ShardingPlan(), mixed_precision="no", compile_plan=CompilePlan())
    rank, world = acc.process_index, acc.num_processes
    model = load_model(args.model)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 2:
                param.mul_(args.weight_scale)
    reference = copy.deepcopy(model)  # unsharded fp32, this rank's own
    layer_cls = decoder_layer_classes(model)
    # the tiny model's linears are all below torchao's size thresholds: converted anyway, for the numerics
    plan = Float8Plan(emulate=True, size_filter=False)
    report = convert_float8(model, layer_cls, plan)
    model = parallelize(model, acc, ParallelPlan(layer_cls=layer_cls))
    opt = build_adamw(param_groups(model, 0.0), lr=3e-3, betas=(0.9, 0.999), eps=1e-8, device_type="cpu")
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
    probe = Float8BoundProbe(
        reference, report.converted, layer_cls_names=list(layer_cls), compute_dtype=torch.float32
    )
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
        with (
            probe
        ):  # the run-time bound (hf_fsdp2/parallel/float8_bound.py) from the same forward and backward
            ref_loss = reference(input_ids=ids, labels=ids).loss
            ref_loss.backward()
        sharp = probe.result()
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
                "sharp_bound": sharp.bound,
                "sharp_worst": sharp.worst,
                "forward_sent": forward_sent,
                "linear_ratio": max(ratios.values()),
                "linear_ratio_min": min(ratios.values()),
            }
        )
        ratios.clear()
    broken = [break_and_compare(m, model, reference, probe, gen) for m in MUTATIONS] if args.broken else []
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
        "broken": broken,
    }
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))
    acc.end_training()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
