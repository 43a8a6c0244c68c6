"""What autograd keeps for backward during a forward, counted by :class:`SavedTensorMeter`: on the meta model
it is the plan's activations and loss (:mod:`hf_fsdp2.plan.compute`); on a real model it
measures a run (tests/distributed/test_memory_plan.py, bench/memory_plan_gpu.py)."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from hf_fsdp2.plan.settings import PlanError


def storages(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages that hold a tensor's data. A wrapper subclass (QLoRA's NF4 weight) owns none of its own (its
    ``untyped_storage()`` is a placeholder of the dequantised size): its inner tensors' storages hold the bytes."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return storages(tensor.to_local())
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
        parts = [getattr(tensor, name) for name in names]
        return [s for part in parts if isinstance(part, torch.Tensor) for s in storages(part)]
    return [tensor.untyped_storage()]


def param_storages(model: torch.nn.Module) -> set[int]:
    """Keys of the storages behind the model's parameters (NF4 weights: their parts)."""
    return {s._cdata for p in model.parameters() for s in storages(p)}


@dataclass(frozen=True)
class SavedBytes:
    """Bytes autograd holds for backward after a forward (unique storages, parameters excluded).

    Attributes:
        activations: saved by the model up to the output head, on the device.
        loss: saved from the output head on (its input, the chunked loss's gradients or the log-probs).
        offloaded: what ``activation_checkpointing=offload`` copies to host memory (the inputs of the
            checkpointed layers, one copy per layer); counted only by ``result(offload_layer_inputs=True)``.
    """

    activations: int
    loss: int
    offloaded: int = 0


@dataclass
class _Saved:
    ref: StorageWeakRef
    places: set[str]


class _SelectiveCache(TorchDispatchMode):
    """Sees the outputs selective checkpointing keeps: its policy caches them in the checkpoint, not through
    ``saved_tensors_hooks``, so the meter asks the same policy (:func:`selective_policy`) inside such a layer."""

    def __init__(self, meter: SavedTensorMeter) -> None:
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.utils.checkpoint import CheckpointPolicy

        from hf_fsdp2.parallel.activations import selective_policy

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        layers = self.meter._layers
        selective = bool(layers) and layers[-1] == "selective" and self.meter._place == "body"
        if selective and selective_policy(None, func, *args, **kwargs) == CheckpointPolicy.MUST_SAVE:
            for value in tree_flatten(out)[0]:
                if isinstance(value, torch.Tensor):
                    self.meter._record(value, "cached")
        return out


def _decoder_layers(model: torch.nn.Module, layer_cls: tuple[str, ...]) -> list[torch.nn.Module]:
    """The decoder layers, sharded or not (FSDP2 makes each an instance of a subclass ``FSDP<class>``)."""
    found: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        inside = any(name.startswith(f + ".") for f, _ in found)
        if not inside and any(c.__name__ in layer_cls for c in type(module).__mro__):
            found.append((name, module))
    return [module for _, module in found]


class SavedTensorMeter:
    """Count what autograd keeps for backward during a forward.

    Every tensor saved through ``saved_tensors_hooks`` is remembered (its storage, weakly) with where it was
    saved: in a decoder layer's call, elsewhere in the model, or from the output head on (the loss). Activation
    checkpointing saves through hooks of its own inside a checkpointed layer, so such a layer shows the inputs
    the checkpoint keeps; under ``selective`` the outputs its policy keeps are counted too (they are cached in
    the checkpoint, not saved through hooks). After the forward, :meth:`result` sums the storages still alive
    at their current size, parameters left out (a gathered FSDP2 parameter that was resharded has size 0).

    Args:
        model: the model (sharded or not, real or meta).
        layer_cls: decoder-layer class names.
    """

    def __init__(self, model: torch.nn.Module, layer_cls: tuple[str, ...]) -> None:
        self.model = model
        self.layer_cls = layer_cls
        self._saved: dict[int, _Saved] = {}
        self._place = "body"
        self._layers: list[str] = []  # checkpointing mode of each decoder layer being called
        self._host = 0
        self._stack = ExitStack()

    def _record(self, tensor: torch.Tensor, place: str) -> None:
        for storage in storages(tensor):
            key = storage._cdata
            entry = self._saved.get(key)
            if entry is None or entry.ref.expired():
                entry = self._saved[key] = _Saved(StorageWeakRef(storage), set())
            entry.places.add(place)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        place = "layer" if self._layers and self._place == "body" else self._place
        self._record(tensor, place)
        if place == "layer":  # save_on_cpu copies each tensor saved there, views included
            self._host += tensor.numel() * tensor.element_size()
        return tensor

    def __enter__(self) -> SavedTensorMeter:
        def enter(layer: torch.nn.Module, *_: Any) -> None:
            self._layers.append(getattr(layer.forward, "__hf_fsdp2_checkpointed__", None) or "none")

        def leave(*_: Any) -> None:
            self._layers.pop()

        def to_loss(*_: Any) -> None:
            self._place = "loss"

        for layer in _decoder_layers(self.model, self.layer_cls):
            self._stack.callback(layer.register_forward_pre_hook(enter).remove)
            self._stack.callback(layer.register_forward_hook(leave).remove)
        head = self.model.get_output_embeddings()  # type: ignore[operator]
        if head is None:
            raise PlanError(f"{type(self.model).__name__} has no output head (get_output_embeddings)")
        # prepend: the loss phase starts before the chunked loss's own pre-hook computes inside the head.
        self._stack.callback(head.register_forward_pre_hook(to_loss, prepend=True).remove)
        self._stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t))
        self._stack.enter_context(_SelectiveCache(self))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def result(self, *, offload_layer_inputs: bool = False) -> SavedBytes:
        """The bytes kept and still alive (call after the forward, before backward).

        Args:
            offload_layer_inputs: count what only the decoder layers' calls saved as host memory (the
                prediction of ``offload`` from a ``full`` forward: save_on_cpu takes exactly those).
        """
        params = param_storages(self.model)
        body = loss = 0
        for key, entry in self._saved.items():
            if key in params or entry.ref.expired():
                continue
            nbytes = torch.UntypedStorage._new_with_weak_ptr(entry.ref.cdata).nbytes()
            if offload_layer_inputs and entry.places == {"layer"}:
                continue
            if entry.places == {"loss"}:
                loss += nbytes
            else:
                body += nbytes
        return SavedBytes(body, loss, self._host if offload_layer_inputs else 0)
