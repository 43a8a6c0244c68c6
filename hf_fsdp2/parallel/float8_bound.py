"""How far an FP8 forward's loss may lie from the same forward without float8 casts, at the same weights: a bound
derived from e4m3 rounding, computed at run time from the reference run's own tensors (the GPU check's FP8
comparison and tests/distributed/test_float8.py use it).

Derivation. A converted linear ``y = x W^T`` casts ``x`` and ``W`` to e4m3 with a tensorwise scale ``s = 448 /
amax``. Round to nearest moves each element by ``r = a t`` with ``|a| <= u = 2^-4`` (3 mantissa bits) in e4m3's
normal range, and by at most ``h = amax 2^-10 / 448`` (half the subnormal spacing, unscaled) below it (the fp32
products ``t s`` and ``q / s`` add ``2^-23``). To first order the loss moves by

    dL = sum over the cast elements t of  (dL/dt) r_t,

where for an input element ``dL/dt`` is the gradient of the linear's input (q, k and v read one tensor, cast with
one scale: one rounding, one term with the summed gradient) and for a weight element it is ``dL/dW`` (one weight
is cast once for every token, so its term is ``r_W G`` with ``G`` the weight's gradient over the whole batch).
Each term lies in ``[-c, c]`` with ``c = u |t dL/dt| + h |dL/dt|``. The worst case adds them all, ``sum c``: every
rounding in the same direction, which grows with every element and is vacuous for a 1B model (the bound this
replaces: ``2 (layers u + 2 u_bf16) loss``, 24 nats at the 1B shape). The probabilistic model of rounding (Higham &
Mary, "A new approach to probabilistic rounding error analysis", 2019): the errors of different elements are
independent, of mean zero, and each uniform over its rounding interval, so ``E[a^2] <= (ulp^2 / 12) / t^2 <= u^2 / 3``
(the ulp of a normal ``t`` is at most ``2u |t|``) and a subnormal's ``E[r^2] <= h^2 / 3``: each term's variance is at
most ``c^2 / 3``. Bernstein's inequality for a sum of independent terms with variance sum ``V = sum c^2 / 3`` and
``|term| <= M = max c``:

    P(|dL| >= t) <= 2 exp(-t^2 / (2 (V + M t / 3))),   so with probability 1 - delta
    |dL| <= l M / 3 + sqrt((l M / 3)^2 + 2 l V),   l = ln(2 / delta)

(``delta = 1e-6``: about ``5.4 sqrt(V) = 3.1 sqrt(sum c^2)``). It grows like the square root of the number of
elements (the probabilistic ``sqrt(K)`` of a K-long dot product, carried through to the loss), where the worst case
grows like the number itself.

The rest of the computation runs in the compute dtype (bf16 on a GPU, unit roundoff ``u_c = 2^-8``) in both runs
but is rounded at different places (regional compile fuses what eager rounds): each linear's output, each decoder
layer's output (the residual stream) and the reference's own cast of the float8 weights count as such sites, with
``c = 2 u_c |t dL/dt|`` (two independent roundings; ``u_c = 2^-24`` in fp32, negligible).

Not in the bound: second-order terms (``O(u^2)`` relative per linear: the observed loss differences stay well
inside it, tests/distributed/test_float8.py), and the update (the bound compares forwards at the same weights).
What it catches: a systematic error, a wrong scale by even ``2^-4`` in every weight (one e4m3 step: it adds up with
the number of elements where rounding cancels), a stale scale that clips values, a wrong layer; it cannot tell
e5m2 from e4m3 in the forward (twice the random error), which the elementwise bound of each float8 linear does
(tests/unit/test_float8_units.py, tests/distributed/test_float8.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

# e4m3fn: 3 mantissa bits (round to nearest: relative error <= 2^-4), largest 448, subnormal spacing 2^-9.
E4M3_UNIT = 2.0**-4 + 2.0**-23
E4M3_MAX = 448.0
E4M3_HALF_SUBNORMAL = 2.0**-10
# The chance that a correct FP8 forward's loss lands outside the bound (Hoeffding), per comparison.
DEFAULT_DELTA = 1e-6


@dataclass(frozen=True, kw_only=True)
class Float8LossBound:
    """The bound's pieces: ``float8_sq`` and ``other_sq`` are the sums of ``c^2`` over the float8 casts' and the
    compute dtype's rounding sites, ``worst`` the first-order worst case ``sum c`` (for comparison), ``largest`` the
    largest ``c``."""

    float8_sq: float
    other_sq: float
    worst: float
    largest: float
    delta: float = DEFAULT_DELTA

    @property
    def bound(self) -> float:
        """Largest ``|L_fp8 - L_ref|`` at the same weights, except with probability ``delta`` (Bernstein, module
        docstring)."""
        log_term = math.log(2 / self.delta)
        variance = (self.float8_sq + self.other_sq) / 3
        shift = log_term * self.largest / 3
        return shift + math.sqrt(shift**2 + 2 * log_term * variance)


def _sums(c: torch.Tensor) -> tuple[float, float, float]:
    """(sum c^2, sum c, max c) of one site's term bounds, in float64."""
    c64 = c.double()
    return float(c64.square().sum()), float(c64.sum()), float(c64.max()) if c64.numel() else 0.0


def _cast_terms(t: torch.Tensor, grad: torch.Tensor) -> tuple[float, float, float]:
    """(sum c^2, sum c, max c) of one e4m3-cast tensor ``t`` with its loss gradient ``grad``, one tensorwise
    scale."""
    t32, g32 = t.detach().float(), grad.detach().float()
    half_sub = float(t32.abs().max()) / E4M3_MAX * E4M3_HALF_SUBNORMAL
    return _sums(E4M3_UNIT * (t32 * g32).abs() + half_sub * g32.abs())


class Float8BoundProbe:
    """Collects the bound's sums from one forward and backward of the *reference* model (the same weights and batch,
    linears not converted). Use as a context manager around the reference's forward and ``backward``, then read
    :meth:`result`. Hooks only the reference; the FP8 model is not touched.

    Args:
        reference: the model without float8 linears, in the compute dtype, parameters requiring gradients.
        float8_linears: the names (in ``reference``) of the linears the FP8 model converted.
        layer_cls_names: the decoder layers' class names (their outputs are rounding sites).
        compute_dtype: the dtype the rest of the computation rounds to (bf16 on a GPU, fp32 on CPU).
        delta: the bound's failure probability.
    """

    def __init__(
        self,
        reference: torch.nn.Module,
        float8_linears: Sequence[str],
        *,
        layer_cls_names: Sequence[str],
        compute_dtype: torch.dtype,
        delta: float = DEFAULT_DELTA,
    ) -> None:
        if not float8_linears:
            raise ValueError("float8_linears is empty: the bound needs the names of the converted linears")
        modules = dict(reference.named_modules())
        missing = [n for n in float8_linears if not isinstance(modules.get(n), torch.nn.Linear)]
        if missing:
            raise ValueError(f"float8_linears {missing[:3]} are not nn.Linear modules of the reference model")
        self.reference = reference
        self.float8 = {n: modules[n] for n in float8_linears}
        self.others = [
            m for n, m in modules.items() if isinstance(m, torch.nn.Linear) and n not in self.float8
        ]
        self.layers = [m for m in modules.values() if type(m).__name__ in set(layer_cls_names)]
        self.u_c = torch.finfo(compute_dtype).eps / 2
        self.delta = delta
        self._handles: list[Any] = []
        self._inputs: dict[int, torch.Tensor] = {}
        self.float8_sq = self.other_sq = self.worst = self.largest = 0.0

    def __enter__(self) -> Float8BoundProbe:
        self.float8_sq = self.other_sq = self.worst = self.largest = 0.0
        self._inputs.clear()
        for mod in self.float8.values():
            self._handles.append(mod.register_forward_hook(self._float8_linear))
        for mod in self.others:
            self._handles.append(mod.register_forward_hook(self._site))
        for mod in self.layers:
            self._handles.append(mod.register_forward_hook(self._site))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._inputs.clear()

    def _add_cast(self, t: torch.Tensor, grad: torch.Tensor) -> None:
        sq, total, top = _cast_terms(t, grad)
        self.float8_sq += sq
        self.worst += total
        self.largest = max(self.largest, top)

    def _add_site(self, t: torch.Tensor, grad: torch.Tensor, rounds: int = 2) -> None:
        sq, total, top = _sums(rounds * self.u_c * (t.detach().float() * grad.detach().float()).abs())
        self.other_sq += sq
        self.worst += total
        self.largest = max(self.largest, top)

    def _watch(self, t: torch.Tensor, add: Any) -> None:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(lambda grad, t=t: add(t, grad))

    def _float8_linear(self, _mod: torch.nn.Module, inputs: tuple[Any, ...], out: Any) -> None:
        x = inputs[0]
        if (
            id(x) not in self._inputs
        ):  # q, k and v (gate and up) cast one input once: one term, summed gradient
            self._inputs[id(x)] = x
            self._watch(x, self._add_cast)
        self._watch(out, self._add_site)

    def _site(self, _mod: torch.nn.Module, _inputs: tuple[Any, ...], out: Any) -> None:
        self._watch(out[0] if isinstance(out, tuple) else out, self._add_site)

    def result(self) -> Float8LossBound:
        """The bound, after the reference's backward (the weights' terms read their gradients now)."""
        for name, mod in self.float8.items():
            if mod.weight.grad is None:
                raise ValueError(
                    f"{name}.weight has no gradient: call result() after the reference's backward"
                )
        saved = (self.float8_sq, self.other_sq, self.worst, self.largest)
        for mod in self.float8.values():
            self._add_cast(mod.weight, mod.weight.grad)  # type: ignore[arg-type]
            # the reference rounds its float8 weights' masters to the compute dtype; the FP8 run casts them to e4m3
            self._add_site(mod.weight, mod.weight.grad, rounds=1)  # type: ignore[arg-type]
        bound = Float8LossBound(
            float8_sq=self.float8_sq,
            other_sq=self.other_sq,
            worst=self.worst,
            largest=self.largest,
            delta=self.delta,
        )
        self.float8_sq, self.other_sq, self.worst, self.largest = saved
        return bound
