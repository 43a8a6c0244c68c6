"""Tolerances derived from the computation, for tests that compare the same maths done in another order.

Chunked vs plain loss, checkpointed vs plain backward, packed vs unpacked rows, compiled vs eager:
each pair computes the same sums in a different order, so the results differ by rounding only. How much
depends on the CPU (vector width, thread count, the BLAS kernel picked for a shape), so a fixed fp32
bound passes on one machine and fails on the next. These tests therefore run the comparison in float64,
where the rounding of a sum of ``terms`` terms is at most ``terms * u * sum|x_i|`` (u = 2**-53, Higham,
"Accuracy and Stability of Numerical Algorithms", 2nd ed., eq. 4.3). The bound below takes the larger
magnitude of the two tensors for ``sum|x_i|`` and allows a factor ``FACTOR`` for the chain of layers
the error passes through; in float64 it is still ~1e-10 of the tensor's scale, while any real mistake
(a missing softcap, a wrong mask, a dropped chunk) moves values by 1e-4 or more of it.
"""

from __future__ import annotations

import torch

# Rounding compounds through the ops of a forward and backward (a few dozen on a 2-layer model);
# 64 covers that chain with room to spare and keeps the bound near 1e-10 of the scale in float64.
FACTOR = 64


def rounding_bound(dtype: torch.dtype, terms: int, scale: float) -> float:
    """Largest difference two summation orders of ``terms`` terms of magnitude ``scale`` can give.

    Args:
        dtype: the dtype the sums are done in.
        terms: the length of the longest reduction in the computation (e.g. the vocabulary size for
            a gradient through the output head, the token count for a weight gradient).
        scale: the magnitude of the values compared.

    Returns:
        ``FACTOR * 2 * terms * u(dtype) * scale`` (each order is within ``terms * u * scale`` of exact).
    """
    u = torch.finfo(dtype).eps / 2
    return FACTOR * 2 * terms * u * max(scale, torch.finfo(dtype).tiny)


def assert_same_maths(
    got: torch.Tensor,
    want: torch.Tensor,
    *,
    terms: int,
    rounding: torch.dtype = torch.float64,
    name: str = "",
) -> float:
    """Assert that two float64 computations of the same quantity differ by rounding only.

    Args:
        got: the result of the path under test.
        want: the reference result.
        terms: the longest reduction done in ``rounding`` (see :func:`rounding_bound`).
        rounding: the narrowest dtype the computation rounds in. float64, unless a kernel upcasts to a
            fixed dtype whatever its inputs (transformers' eager attention takes its softmax in float32:
            then ``rounding=torch.float32`` and ``terms`` is the attention row length).
        name: what is compared, for the failure message.

    Returns:
        The largest absolute difference divided by the bound (for reporting margins).

    Raises:
        AssertionError: the tensors are not float64 (a float32 bound would depend on the CPU), differ
            in shape, or differ by more than the bound.
    """
    assert got.dtype == want.dtype == torch.float64, (
        f"{name}: compare in float64, got {got.dtype}/{want.dtype}"
    )
    assert got.shape == want.shape, f"{name}: shapes {tuple(got.shape)} vs {tuple(want.shape)}"
    got, want = got.detach(), want.detach()
    scale = float(torch.maximum(got.abs().max(), want.abs().max())) if want.numel() else 0.0
    bound = rounding_bound(rounding, terms, scale)
    diff = float((got - want).abs().max()) if want.numel() else 0.0
    assert diff <= bound, (
        f"{name}: max |diff| {diff:.3e} > {bound:.3e} "
        f"(rounding of {terms} {str(rounding).removeprefix('torch.')} terms at scale {scale:.3e}): "
        "not the same maths"
    )
    return diff / bound
