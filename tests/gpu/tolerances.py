"""The bf16 tolerance of the GPU checks' loss comparisons, derived from where the computation rounds.

Two runs of the same maths whose kernels differ (eager vs compiled, activation offload vs not) round to bf16
at different places. Along a token's path through a decoder-only model the values are rounded to bf16 at
``depth`` places that matter for the loss: each decoder layer's output added to the residual stream, the
final norm and the output head's logits (``depth = layers + 2``). Each rounding is within a relative
``u = 2**-8`` (bf16's unit roundoff: 8 significant bits) of its value; to first order the errors add, so a
logit moves by at most ``depth * u * scale``, and a token's cross entropy ``logsumexp(z) - z_y`` by at most
twice that. The loss is a mean of such terms, so the same bound holds for it. ``scale`` is the size of the
values compared (the loss itself: an upper bound on the mean cross entropy's terms for the checks' models).
A wrong mask, a dropped layer, a stale saved activation or a NaN moves the loss by more; a fixed guess would
pass on one model and fail on the next.

The FP8 comparison does not use a tolerance of this kind: its first-order worst case (every e4m3 rounding of every
layer in the same direction, ``2 (layers 2^-4 + 2 u) loss``) was 24 nats at the 1B shape, a check that could not
fail. The FP8 runner instead computes, before each warm-up step, the same forward without float8 casts at the same
weights and a bound derived from e4m3 rounding with Bernstein's inequality over the run's own tensors
(hf_fsdp2/parallel/float8_bound.py).
"""

from __future__ import annotations

import torch


def bf16_loss_tolerance(scale: float, layers: int) -> float:
    """Largest loss difference two bf16 roundings of the same maths give (see the module docstring)."""
    if layers < 1:
        raise ValueError(f"layers={layers}: a decoder-only model has at least one layer")
    u = torch.finfo(torch.bfloat16).eps / 2
    return 2 * (layers + 2) * u * abs(scale)


def fp8_probe_figures(probes: list[dict[str, float]]) -> dict[str, float | list[float]]:
    """The GPU check's FP8 figures from the runner's same-weights probes (bench/gpu_bench_hf.py): each warm-up step's
    ``|L_fp8 - L_ref|`` over its bound (``fp8_probe_max_ratio``: the check fails above 1), the bounds themselves and
    the first-order worst case they replace. No probe is a failure: the check would then assert nothing."""
    if not probes:
        raise AssertionError("the FP8 runner reported no same-weights probe: nothing to hold its loss to")
    diffs = [abs(p["fp8_loss"] - p["ref_loss"]) for p in probes]
    return {
        "fp8_probe_max_ratio": max(d / p["bound"] for d, p in zip(diffs, probes, strict=True)),
        "fp8_loss_diff": diffs,
        "fp8_bound": [p["bound"] for p in probes],
        "fp8_worst_case": [p["worst_case"] for p in probes],
    }
