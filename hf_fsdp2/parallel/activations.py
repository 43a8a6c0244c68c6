"""Activation checkpointing modes, applied per decoder layer before sharding, and what each saves.

Modes (config ``activation_checkpointing``, docs/performance.md has the measured trade-offs):

- ``none``: every activation autograd needs is kept from forward to backward.
- ``full``: each decoder layer keeps only its input; its forward runs again in backward.
- ``every_k``: ``full`` on layers 0, k, 2k, ... (``ac_every_k``); the others keep everything. A dial
  between the two above.
- ``selective``: each decoder layer keeps the outputs of its matmuls and attention (and, under tensor
  parallel, of its reduce-scatters) and recomputes the cheap rest (norms, activations, rotary embeddings,
  residual adds) in backward: most of ``full``'s saving of elementwise tensors at a fraction of its
  recompute cost.
- ``offload``: ``full``, and the one tensor each layer keeps (its input) goes to host memory (pinned)
  until backward needs it; nothing else does, compiled or not (:class:`OffloadLayerInputs`). Only
  meaningful with a GPU.

Each selected layer's ``forward`` is replaced by the same forward under non-reentrant
``torch.utils.checkpoint``; the module itself is not wrapped. Parameter names, state dicts and DCP
checkpoints are therefore the same in every mode, FSDP2's hooks run outside the checkpointed region
(no all-gather is recorded or replayed inside it), and ``torch.compile`` of the forward traces the
checkpoint, selective policy included, as one region.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from hf_fsdp2.config.plans import ACPlan

_aten = torch.ops.aten
# Outputs the selective mode keeps: everything expensive to recompute (FLOPs grow with the sequence or
# the hidden size squared). Attention kernels return several tensors (output, logsumexp, ...); all are kept.
# Under tensor parallel's sequence layout a row-wise projection's output leaves in a reduce-scatter: kept too (a
# 1/tp share of the sequence, where recomputing it repeats the collective in backward, as torchtitan's policy
# keeps it); the all-gathers into each block are recomputed (their whole-sequence outputs would cost tp x that).
_SAVED_OPS = {
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def selective_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep matmul and attention outputs; recompute everything else (``selective`` mode)."""
    return CheckpointPolicy.MUST_SAVE if func in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


# A module-level partial: torch.compile traces a checkpoint whose context_fn it can see as a partial of
# create_selective_checkpoint_contexts (the form torch's own checkpoint_wrapper passes).
_SELECTIVE_CONTEXT = functools.partial(create_selective_checkpoint_contexts, selective_policy)


def _needs_rng(model: torch.nn.Module, layer: torch.nn.Module) -> bool:
    """Whether the layer's forward draws random numbers: dropout modules (LoRA's) or a dropout rate in
    the config (attention dropout is functional, passed to the attention kernel)."""
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in layer.modules()):
        return True
    config = getattr(model, "config", None)
    return any(
        float(getattr(config, key, 0.0) or 0.0) > 0
        for key in ("attention_dropout", "hidden_dropout", "resid_pdrop", "attn_pdrop", "dropout")
    )


class OffloadLayerInputs(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that send the layer's inputs to host memory and leave every other saved tensor alone.

    Eager, the checkpoint saves only the layer's inputs through the hooks around it (what it saves inside goes
    through its own hooks). Compiled (regional or whole-model), the checkpoint is part of the layer's graph and
    the graph saves what its partitioner keeps for the recompute: the input, but also the layer's (unsharded)
    parameters, the rotary tables and an RNG state, all through the hooks active when it runs. Plain
    ``save_on_cpu`` therefore copied every layer's gathered weights to host memory and back (~14 GB per
    micro-batch per GPU on an 8B model). A saved tensor is moved when it shares storage with one of the
    layer's positional tensor arguments (a view of the input included), so eager and compiled runs move the
    same bytes; the copy itself is ``save_on_cpu``'s (pinned, asynchronous).

    Args:
        inputs: the layer's positional arguments (the hidden states; kwargs are not saved by the checkpoint).
        pin_memory: copy into pinned host memory, asynchronously (needs CUDA).
    """

    def __init__(self, inputs: tuple[Any, ...], pin_memory: bool) -> None:
        host = torch.autograd.graph.save_on_cpu(pin_memory=pin_memory)
        to_host, from_host = host.pack_hook, host.unpack_hook
        # Storage identity, not data_ptr: meta storages all sit at address 0.
        storages = {a.untyped_storage()._cdata for a in inputs if isinstance(a, torch.Tensor)}

        def pack(tensor: torch.Tensor) -> tuple[bool, Any]:
            if tensor.untyped_storage()._cdata in storages:
                return True, to_host(tensor)
            return False, tensor

        def unpack(packed: tuple[bool, Any]) -> torch.Tensor:
            moved, value = packed
            return from_host(value) if moved else value

        super().__init__(pack, unpack)


def checkpointed_forward(
    forward: Callable[..., Any], plan: ACPlan, *, preserve_rng_state: bool
) -> Callable[..., Any]:
    """``forward`` run under non-reentrant ``torch.utils.checkpoint`` as ``plan`` says.

    Only the forward is checkpointed, not the module call: hooks on the module (FSDP2's all-gather
    before forward and reshard after) stay outside the checkpoint, as torchtitan arranges it by
    sharding the checkpoint wrapper. Recompute in backward then runs on the weights FSDP2 gathered
    for backward, and torch.compile of the forward traces the checkpoint as one region.
    """
    selective = plan.mode == "selective"

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        def call() -> Any:
            if selective:
                return checkpoint(
                    forward,
                    *args,
                    use_reentrant=False,
                    preserve_rng_state=preserve_rng_state,
                    context_fn=_SELECTIVE_CONTEXT,
                    **kwargs,
                )
            return checkpoint(
                forward, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs
            )

        if plan.mode == "offload":
            with OffloadLayerInputs(args, plan.pin_memory):
                return call()
        return call()

    run.__hf_fsdp2_checkpointed__ = plan.mode  # type: ignore[attr-defined]
    if plan.mode == "offload":
        # torch.compile skips this frame and compiles the checkpointed call inside it: the hooks are built from
        # the real inputs and are active, outside the graph, when the compiled layer saves its tensors.
        return torch.compiler.disable(run, recursive=False)
    return run


def decoder_layers(
    model: torch.nn.Module, layer_cls_names: tuple[str, ...]
) -> list[tuple[str, torch.nn.Module]]:
    """``(qualified name, module)`` of each decoder layer, in forward order (outermost match only)."""
    found: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if type(module).__name__ in layer_cls_names and not any(name.startswith(f + ".") for f, _ in found):
            found.append((name, module))
    return found


def apply_activation_checkpointing(
    model: torch.nn.Module, plan: ACPlan, layer_cls_names: tuple[str, ...]
) -> list[str]:
    """Wrap the decoder layers ``plan`` selects, in place, before ``fully_shard``.

    Args:
        model: the unsharded model.
        plan: the mode.
        layer_cls_names: decoder-layer class names (``model.decoder_layer_classes``).

    Returns:
        Names of the wrapped layers.

    Raises:
        ValueError: no decoder layer found for a mode that needs them.
    """
    if plan.mode == "none":
        return []
    layers = decoder_layers(model, layer_cls_names)
    if not layers:
        raise ValueError(
            f"activation_checkpointing={plan.mode!r} found no decoder layer of classes {list(layer_cls_names)} "
            f"in {type(model).__name__}; set fsdp_layer_cls_to_wrap"
        )
    wrapped = []
    for index, (name, layer) in enumerate(layers):
        if not plan.wraps(index):
            continue
        if getattr(layer.forward, "__hf_fsdp2_checkpointed__", None):
            raise ValueError(f"decoder layer {name} is already activation-checkpointed")
        # RNG state is restored for the recompute where the forward draws random numbers (dropout), so the
        # recomputed forward draws the same masks; it costs a copy of the RNG state per layer.
        layer.forward = checkpointed_forward(layer.forward, plan, preserve_rng_state=_needs_rng(model, layer))
        wrapped.append(name)
    return wrapped


class _LiveOutputs(TorchDispatchMode):
    """Remember (weakly) the storage of every tensor an op returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor) and value.device.type != "meta":
                storage = value.untyped_storage()
                try:
                    ptr = storage.data_ptr()
                except (
                    RuntimeError
                ):  # a wrapper subclass (an async collective's result): its data is counted where made
                    continue
                known = self.storages.get(ptr)
                # An address is reused once its storage is freed: the newest storage there is the one that counts.
                if storage.nbytes() and (known is None or known[0].expired()):
                    self.storages[ptr] = (StorageWeakRef(storage), storage.nbytes())
        return out


def activation_bytes(model: torch.nn.Module, forward: Callable[[], torch.Tensor]) -> int:
    """Bytes the forward leaves alive for backward: the activation memory of one micro-batch.

    Every storage an op creates during ``forward`` is tracked by a weak reference; once the forward has
    returned, those still alive are what autograd (saved tensors), activation checkpointing (layer
    inputs) and selective checkpointing (kept matmul outputs) hold until backward, plus the loss. The
    count does not depend on an allocator, so it is exact on CPU and compares the modes deterministically.
    Measure on an unsharded model: FSDP2 frees gathered weights by resizing storages, which this does
    not see.

    Args:
        model: the model (its parameters' storages are never counted).
        forward: runs one forward and returns the scalar loss. It is run twice (a warm-up, then the
            measured one), each followed by backward; the gradients are cleared afterwards.

    Returns:
        Live bytes after the forward.
    """
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    forward().backward()  # warm-up: caches filled on a first call are not activations
    for p in model.parameters():
        p.grad = None
    gc.collect()
    tracker = _LiveOutputs()
    with tracker:
        loss = forward()
    gc.collect()
    live = sum(
        nbytes for ptr, (ref, nbytes) in tracker.storages.items() if not ref.expired() and ptr not in params
    )
    loss.backward()
    for p in model.parameters():
        p.grad = None
    return live
