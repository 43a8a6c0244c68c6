"""The verification's probe: logits of the live model computed with its weights rounded to the export dtype,
so that a reload of the export (same weights, same compute dtype) differs by kernel noise only."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def probe_ids(vocab_size: int) -> torch.Tensor:
    """A fixed probe batch: 2 x 16 token ids drawn with a fixed seed (the same on every rank)."""
    return torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(1234))


# The live model may run other kernels than the reload (a GPU's GEMMs, split-K reductions and flash attention
# against a CPU's): each rounds differently, by about as much as the reload itself rounds. The limit allows the
# live side up to 3x the reload's own measured rounding noise: |live - reload| <= |live - exact| + |exact - reload|.
NOISE_MARGIN = 4.0


def reference_dtype(compute_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype in which the reload computes the probe a second time to measure its own rounding noise: float32
    for bf16/fp16 compute; None for fp32/fp64, whose noise is far below the relative floor."""
    return torch.float32 if compute_dtype in (torch.bfloat16, torch.float16) else None


# mixed_precision=fp8: the live model's decoder-layer matmuls round their operands to e4m3 (unit roundoff 2^-4),
# the reload computes them in the compute dtype (bf16: 2^-8); the live side's rounding is that ratio larger.
FLOAT8_NOISE_RATIO = 2.0**-4 / 2.0**-8


def live_float8(model: torch.nn.Module) -> bool:
    """True when the live model computes linears in float8 (torchao's ``Float8Linear``: ``mixed_precision=fp8``)."""
    return any(type(m).__name__ == "Float8Linear" for m in model.modules())


def probe_limit(
    compute_dtype: torch.dtype, logit_scale: float, noise: float = 0.0, *, float8: bool = False
) -> float:
    """The largest probe-logit difference accepted when the reload uses the live model's rounded weights
    and compute dtype: only kernels differ (another device, another summation order, another attention
    kernel).

    Two terms, the larger wins:

    * a floor relative to the logit scale (at least 1): 1e-3 in fp32, 5e-2 in bf16/fp16, where one rounding of
      an activation is already 4e-3;
    * ``NOISE_MARGIN`` x the reload's measured rounding noise: the largest difference between its logits in the
      compute dtype and in :func:`reference_dtype` (same weights, same process). A deep model accumulates
      rounding through its layers (SmolLM2-135M in bf16: 1.2 at a logit scale of 35, 3.4 %), and the live
      model's kernels (a GPU's) round as much again in their own way; a fixed relative limit would reject
      correct exports of deep models, this one scales with what the model's rounding actually does.

    Mapping mistakes are caught exactly by checks 1-3; the probe is the backstop for what they cannot see.

    Args:
        compute_dtype: the dtype both sides compute in.
        logit_scale: the largest live logit magnitude.
        noise: the reload's measured rounding noise (0: not measured).
        float8: the live model computes in float8 (:func:`live_float8`): the noise term is ``FLOAT8_NOISE_RATIO``
            times larger (its floor stays: the exact checks 1-3 still compare every byte).

    Returns:
        The limit (absolute).
    """
    rel = 1e-3 if compute_dtype in (torch.float32, torch.float64) else 5e-2
    return max(rel * max(1.0, logit_scale), NOISE_MARGIN * noise * (FLOAT8_NOISE_RATIO if float8 else 1.0))


def _units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules whose forward brackets the use of their own parameters: FSDP2 units, else the root."""
    from torch.distributed.fsdp import FSDPModule

    units: list[torch.nn.Module] = [m for m in model.modules() if isinstance(m, FSDPModule)]
    return units or [model]


@contextmanager
def rounded_weights(model: torch.nn.Module, dtypes: dict[str, torch.dtype]) -> Iterator[None]:
    """For the forwards inside, each named parameter holds its value rounded to ``dtypes[name]``.

    Each unit's own parameters are rounded in place just before its forward (before FSDP2 gathers them,
    so a mixed-precision cast then rounds the rounded value, as a reload of the export does) and
    restored bit for bit right after it: at most one unit's shards (and the root's) are kept twice.
    FSDP2 units are resharded afterwards, so no rounded gathered copy survives.

    Args:
        model: the live model (FSDP2-sharded or not).
        dtypes: parameter name (clean) -> the dtype its export holds; names not given are left alone.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():  # the masters registered, not a gathered copy left by an earlier call
        if isinstance(module, FSDPModule):
            module.reshard()
    units = _units(model)
    unit_ids = {id(u) for u in units}
    prefixes = {id(u): n for n, u in model.named_modules() if id(u) in unit_ids}
    # fully_shard([norm, lm_head]) makes one group of several modules, gathered when the first one runs.
    group_of = {id(u): _group_key(u) for u in units}
    members: dict[int, list[torch.nn.Module]] = {}
    for unit in units:
        members.setdefault(group_of[id(unit)], []).append(unit)
    owner: dict[str, torch.nn.Module] = {}
    for unit in sorted(units, key=lambda u: -len(prefixes[id(u)])):  # innermost first
        prefix = prefixes[id(unit)]
        for name, _ in unit.named_parameters():
            owner.setdefault(f"{prefix}.{name}" if prefix else name, unit)
    todo: dict[int, list[tuple[torch.nn.Module, str, torch.dtype]]] = {}
    for name, p in model.named_parameters():
        name = name
        want = dtypes.get(name)
        if want is not None and p.is_floating_point() and want != p.dtype and name in owner:
            unit = owner[name]
            prefix = prefixes[id(unit)]
            todo.setdefault(group_of[id(unit)], []).append(
                (unit, name[len(prefix) + 1 :] if prefix else name, want)
            )
    saved: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    pending: dict[int, int] = {}

    def restore(key: int) -> None:
        with torch.no_grad():
            for t, old in saved.pop(key, []):
                t.copy_(old)

    def pre(unit: torch.nn.Module, args: Any) -> None:
        key = group_of[id(unit)]
        if key in saved:  # another module of the group already rounded it
            return
        pairs = []
        with torch.no_grad():
            for owner_unit, rel, want in todo[key]:
                p = dict(owner_unit.named_parameters())[rel]
                t = p.to_local() if isinstance(p, DTensor) else p  # the master shard, or a plain tensor
                pairs.append((t, t.clone()))
                t.copy_(t.to(want))
        saved[key], pending[key] = pairs, len(members[key])

    def post(unit: torch.nn.Module, args: Any, output: Any) -> None:
        key = group_of[id(unit)]
        pending[key] = pending.get(key, 1) - 1
        if pending[key] <= 0:
            restore(key)

    handles = []
    for unit in units:
        if group_of[id(unit)] in todo:
            # prepend: before fully_shard's own pre-forward hook gathers the unit
            handles.append(unit.register_forward_pre_hook(pre, prepend=True))
            handles.append(unit.register_forward_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for key in list(saved):
            restore(key)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def _group_key(unit: torch.nn.Module) -> int:
    """Modules that FSDP2 gathers together (one ``fully_shard`` call) share a key."""
    get_state = getattr(unit, "_get_fsdp_state", None)
    return id(get_state()) if callable(get_state) else id(unit)


def live_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The live model's logits on ``ids`` (every rank: FSDP2's forward gathers one unit at a time)."""
    was_training = model.training
    model.eval()
    try:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            out = model(input_ids=ids.to(device), attention_mask=torch.ones_like(ids).to(device))
        logits = out.logits
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        return logits.detach().float().cpu()
    finally:
        model.train(was_training)


def compute_dtype_of(model: torch.nn.Module, compute_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype the live model computes in: the given one, else its first floating parameter's."""
    if compute_dtype is not None:
        return compute_dtype
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
