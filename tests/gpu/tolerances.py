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
"""

from __future__ import annotations

import torch


def bf16_loss_tolerance(scale: float, layers: int) -> float:
    """Largest loss difference two bf16 roundings of the same maths give (see the module docstring)."""
    if layers < 1:
        raise ValueError(f"layers={layers}: a decoder-only model has at least one layer")
    u = torch.finfo(torch.bfloat16).eps / 2
    return 2 * (layers + 2) * u * abs(scale)


def fp8_loss_tolerance(scale: float, layers: int) -> float:
    """Largest loss difference between a ``mixed_precision=fp8`` run and a bf16 run of the same maths, by the same
    first-order argument: each decoder layer's output now comes from torchao float8 matmuls whose operands are
    rounded to e4m3 (unit roundoff ``2**-4``: 3 mantissa bits) where bf16 rounds at ``2**-8``; the final norm and
    the head stay bf16. So ``2 * (layers * 2**-4 + 2 * 2**-8) * scale``. A worst case (every rounding of every layer
    in the same direction): loose for a deep model, where it only catches a broken FP8 path (NaN, a diverging or
    wrong loss); the sharp elementwise bounds of each float8 linear are tested on CPU (tests/unit/test_float8_units.py,
    tests/distributed/test_float8.py)."""
    if layers < 1:
        raise ValueError(f"layers={layers}: a decoder-only model has at least one layer")
    return 2 * (layers * 2.0**-4 + 2 * torch.finfo(torch.bfloat16).eps / 2) * abs(scale)
