"""A second device on a CPU-only machine: tensors marked as living on an accelerator, and a torch function mode
that enforces torch's cross-device rules on them.

On a GPU machine the model's shards live on the GPU while files, collators and reloads give CPU tensors, and an
op that mixes the two raises ("Expected all tensors to be on the same device"). On CPU every tensor is a CPU
tensor and such a mistake passes unseen. :class:`FakeAccelerator` makes it visible: a tensor marked with
:meth:`FakeAccelerator.put` (or moved there with ``.to("cuda")`` / ``.cuda()``, or created with ``device="cuda"``
while the mode is active) reports ``cuda:0`` as its device and carries the mark through every op; an op mixing a
marked tensor with an unmarked one of more than one element raises as torch does across devices (0-dim host
scalars are allowed, as torch allows them, and so are copies and host index tensors). ``.cpu()`` / ``.to("cpu")``
return unmarked copies.

It also records host reads of device tensors (``.item()``, ``.tolist()``, ``float(t)``, ``bool(t)``,
``.cpu()``, ``nonzero()``, boolean-mask indexing): each one waits for the GPU, so the list shows the host syncs a
code path makes.

Limits: autograd's backward and optimizers run outside the mode (gradients come back unmarked), and
``torch.cuda`` functions are not faked: use it on forward, export and bookkeeping paths.
"""

from __future__ import annotations

import traceback
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

DEVICE = torch.device("cuda", 0)

# Ops that are legal across devices in torch.
_CROSS_DEVICE_OK = {
    torch.Tensor.copy_,
    torch.Tensor.untyped_storage,
    torch.Tensor.data_ptr,
    torch._has_compatible_shallow_copy_type,
}
# Host reads of a device tensor: each one waits for the device.
_HOST_READS = {
    torch.Tensor.item: "item()",
    torch.Tensor.tolist: "tolist()",
    torch.Tensor.__float__: "float()",
    torch.Tensor.__int__: "int()",
    torch.Tensor.__bool__: "bool()",
    torch.Tensor.__index__: "index()",
    torch.Tensor.nonzero: "nonzero()",
    torch.nonzero: "nonzero()",
    torch.Tensor.__format__: "format()",
}
_DEVICE_GETTERS = {torch.Tensor.device.__get__, torch.Tensor.is_cuda.__get__, torch.Tensor.is_cpu.__get__}  # type: ignore[attr-defined]


def _is_accel(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True
    try:
        return torch.device(device).type == DEVICE.type
    except (RuntimeError, TypeError):
        return False


def _is_host(device: Any) -> bool:
    try:
        return device is not None and not isinstance(device, int) and torch.device(device).type == "cpu"
    except (RuntimeError, TypeError):
        return False


class CrossDeviceError(RuntimeError):
    """What torch raises on a GPU when an op mixes devices."""


class FakeAccelerator(TorchFunctionMode):
    """The torch function mode of a fake ``cuda:0`` (see the module docstring).

    Attributes:
        mismatches: ``(op, where)`` of every cross-device op (they raise unless ``strict=False``).
        host_reads: ``(what, where)`` of every host read of a device tensor.
    """

    def __init__(self, *, strict: bool = True) -> None:
        super().__init__()
        self.strict = strict
        self._marked: dict[int, weakref.ref[torch.Tensor]] = {}  # by id (tensors compare by value)
        # Views and parameters share their base's storage, which keeps one Python object while it lives: marked
        # through it.
        self._storages: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.mismatches: list[tuple[str, str]] = []
        self.host_reads: list[tuple[str, str]] = []

    # -- marks ---------------------------------------------------------------------------------------------

    def put(self, *tensors: torch.Tensor) -> None:
        """Mark ``tensors`` as living on the device (their storage too: views and parameters follow)."""
        for t in tensors:
            self._mark(t)

    def put_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Mark every parameter and buffer of ``module``; returns it."""
        for t in [*module.parameters(), *module.buffers()]:
            self._mark(t)
        return module

    def on_device(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives on the fake device."""
        ref = self._marked.get(id(t))
        if ref is not None and ref() is t:
            return True
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):  # a wrapper subclass (DTensor): no storage
            return False
        held = self._storages.get(id(storage))
        return held is not None and held() is storage

    def _mark(self, t: torch.Tensor) -> None:
        self._marked[id(t)] = weakref.ref(t)
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return
        self._storages[id(storage)] = weakref.ref(storage)

    # -- the mode ------------------------------------------------------------------------------------------

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func in _DEVICE_GETTERS:
            on = self.on_device(args[0])
            if func == torch.Tensor.device.__get__:  # type: ignore[attr-defined]
                return DEVICE if on else func(*args)
            return on if func == torch.Tensor.is_cuda.__get__ else not on  # type: ignore[attr-defined]
        if func in (torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda):
            return self._move(func, args, kwargs)
        if func in _HOST_READS and isinstance(args[0], torch.Tensor) and self.on_device(args[0]):
            self.host_reads.append((_HOST_READS[func], _where()))
        if func is torch.Tensor.numpy and self.on_device(args[0]):
            self._fail("numpy() of a device tensor")
        if "device" in kwargs and _is_accel(kwargs["device"]):  # a factory on the device
            kwargs["device"] = "cpu"
            out = func(*args, **kwargs)
            self._mark_outputs(out)
            return out
        # Meta tensors hold no data and meet any device.
        leaves = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor) and not x.is_meta]
        marked = [x for x in leaves if self.on_device(x)]
        if marked and func not in _CROSS_DEVICE_OK:
            self._check(func, args, leaves)
        if func is torch.Tensor.__getitem__ and marked and self.on_device(args[0]):
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
                self.host_reads.append(("boolean-mask indexing", _where()))
        out = func(*args, **kwargs)
        if marked and func not in _CROSS_DEVICE_OK:  # nonzero() reads the host but returns a device tensor
            self._mark_outputs(out)
        return out

    def _check(self, func: Callable[..., Any], args: tuple[Any, ...], leaves: list[torch.Tensor]) -> None:
        if func in (torch.cat, torch.stack, torch.concat):
            bad = any(not self.on_device(x) for x in leaves)
        elif func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_):
            # Host index tensors may index a device tensor; a device index cannot index a host tensor.
            target = args[0]
            values = args[2] if len(args) > 2 and isinstance(args[2], torch.Tensor) else None
            bad = (not self.on_device(target)) or (
                values is not None and values.dim() > 0 and not self.on_device(values)
            )
        else:
            bad = any(not self.on_device(x) and x.dim() > 0 for x in leaves)
        if bad:
            self._fail(str(getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))))

    def _fail(self, name: str) -> None:
        where = _where()
        self.mismatches.append((name, where))
        if self.strict:
            raise CrossDeviceError(
                f"Expected all tensors to be on the same device, but found at least two devices, {DEVICE} and "
                f"cpu! (in {name}, at {where})"
            )

    def _move(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        src: torch.Tensor = args[0]
        if func is torch.Tensor.cpu:
            target: Any = "cpu"
            rest: tuple[Any, ...] = ()
        elif func is torch.Tensor.cuda:
            target, rest = DEVICE, ()
            kwargs.pop("device", None)
        else:
            target, rest = None, tuple(args[1:])
            if "device" in kwargs:
                target = kwargs.pop("device")
            elif rest and isinstance(rest[0], torch.Tensor):  # .to(other): its device and dtype
                other = rest[0]
                target = DEVICE if self.on_device(other) else other.device
                rest = (other.dtype, *rest[1:])
            elif rest and isinstance(rest[0], (str, torch.device, int)):
                target, rest = rest[0], rest[1:]
        src_on = self.on_device(src)
        if _is_accel(target):
            out = src.to(*rest, **kwargs)
            if not src_on:  # host -> device: a copy, marked
                out = out.clone() if out is src else out
                self.put(out)
            elif out is not src:
                self.put(out)
            return out
        if _is_host(target):
            out = src.to(*rest, **kwargs)
            if src_on:  # device -> host: an unmarked copy
                self.host_reads.append(("cpu()", _where()))
                out = out.clone()
                self._unmark(out)
            return out
        out = src.to(*rest, **kwargs)  # dtype only: stays where it is
        if src_on and out is not src:
            self.put(out)
        return out

    def _unmark(self, t: torch.Tensor) -> None:
        self._marked.pop(id(t), None)

    def _mark_outputs(self, out: Any) -> None:
        def mark(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                self._mark(x)
            return x

        tree_map(mark, out)


def _where() -> str:
    """The innermost frame of the code under test (outside torch and this module)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        name = frame.filename
        if "/torch/" not in name and not name.endswith("devices.py"):
            return f"{name.rsplit('/', 2)[-2]}/{name.rsplit('/', 1)[-1]}:{frame.lineno} {frame.name}"
    return "?"


@contextmanager
def other_kernels(model: torch.nn.Module, *, ulps: float, seed: int = 0) -> Iterator[None]:
    """The model computes as another device's kernels would: each ``nn.Linear`` output in a half-precision dtype
    is moved by up to ``ulps`` units in its last place (uniform, seeded), and attention runs the eager kernel.

    A GPU's GEMMs accumulate in another order and, for the skinny shapes of a probe batch, split the reduction
    with partial sums rounded to bf16 (``allow_bf16_reduced_precision_reduction``, on by default); its flash
    attention rounds the softmax to bf16 before the second product. Each output then differs from a CPU's by
    up to an ulp or two, and the differences compound through the layers as a GPU's do. Restored on exit.
    """
    gen = torch.Generator().manual_seed(seed)

    def perturb(module: torch.nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        if out.dtype not in (torch.bfloat16, torch.float16):
            return out
        x = out.float()
        mantissa = 7 if out.dtype == torch.bfloat16 else 10
        ulp = torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - mantissa)
        noise = (torch.rand(x.shape, generator=gen) * 2 - 1) * ulps * ulp
        return (x + noise.to(x.device)).to(out.dtype)

    handles = [m.register_forward_hook(perturb) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    config: Any = getattr(model, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    if attention is not None:
        model.set_attn_implementation("eager")  # type: ignore[operator]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        if attention is not None:
            model.set_attn_implementation(attention)  # type: ignore[operator]
