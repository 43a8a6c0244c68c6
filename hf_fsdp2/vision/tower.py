"""The vision tower runs in every forward of an image run, on every rank, so that every rank runs the same collectives.

The tower (and a projector of its own) is one FSDP2 unit: its parameters are all-gathered when it runs, and its
gradients reduce-scattered after its backward when it trains. The composite runs it only when the batch has images,
so a rank whose micro-batch is text-only would skip collectives that the ranks with images wait in: a hang. Here a
forward without images runs the tower and projector on a small dummy image instead (``get_image_features``) and adds
``0 x`` its outputs to the input embeddings: the collectives match, and a trained tower and projector take a zero
gradient from that rank (their reduce-scatter runs; FSDP2 averages it in). Every forward of the model runs the tower
exactly once.

The composites also return their image features beside the logits (``image_hidden_states``, ``image_outputs``).
FSDP2 hooks every output of the root that requires a gradient: on a rank with images the features' gradient would
fire the root's pre-backward a second time, and its backward prefetch would all-gather a unit the ranks without images
never gather (seen: a hang in the first backward of a trained tower). They are dropped from the output before FSDP2
sees it (the step reads the logits and the loss only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

IMAGE_INPUTS = ("pixel_values", "mm_encoder_outputs")
"""Forward arguments that make the composite run its tower itself."""


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model of ``model`` (a PEFT model's: the model it wraps)."""
    base = getattr(model, "get_base_model", None)  # a PEFT model: the transformers model it wraps
    return base() if callable(base) else model


def _float_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, dict) or hasattr(value, "values") and callable(value.values):
        return [t for v in value.values() for t in _float_tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _float_tensors(v)]
    return []


@dataclass
class TowerInEveryStep:
    """The hooks that run the tower on a dummy image in a forward without images (:func:`run_tower_always`).

    Attributes:
        dummy: ``get_image_features`` keyword arguments of the dummy image (host tensors).
        dummy_runs: forwards that ran the tower on the dummy (a test reads it).
        handles: the hooks, removed by :meth:`remove`.
    """

    dummy: dict[str, torch.Tensor]
    dummy_runs: int = 0
    handles: list[RemovableHandle] = field(default_factory=list)
    _pending: bool = False

    def remove(self) -> None:
        """Remove the hooks (the model then runs its tower on image batches only)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def run_tower_always(model: torch.nn.Module, dummy: dict[str, torch.Tensor]) -> TowerInEveryStep:
    """Make every forward of ``model`` (a composite, or a PEFT model over one) run its vision tower and projector:
    a forward without image inputs runs them on ``dummy`` (``get_image_features`` keyword arguments) and adds
    ``0 x`` the outputs to the input embeddings. Every rank calls it (an image run's model, before the first step).

    Returns:
        The hooks.
    """
    inner: Any = unwrap_model(model)
    features = inner.get_image_features
    embeddings = inner.get_input_embeddings()
    state = TowerInEveryStep(dummy=dummy)

    def before(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        state._pending = not any(kwargs.get(k) is not None for k in IMAGE_INPUTS)

    def after(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        if not state._pending:
            return output
        state._pending = False  # once per forward: the embedding may be called again (a reference's logits)
        state.dummy_runs += 1
        inputs = {k: v.to(output.device, non_blocking=True) for k, v in state.dummy.items()}
        tensors = _float_tensors(features(**inputs))
        zero = sum((t.sum() for t in tensors), start=torch.zeros((), device=output.device))
        return output + (zero * 0).to(output.dtype)

    # On the model the step calls: PEFT calls the wrapped model's forward directly, so its hooks would not run.
    def drop_image_outputs(module: torch.nn.Module, args: tuple, output: Any) -> Any:
        for key in [k for k in getattr(output, "keys", list)() if k.startswith(("image_", "video_"))]:
            output[key] = None
        return output

    state.handles.append(model.register_forward_pre_hook(before, with_kwargs=True))
    # Before FSDP2's own post-forward hook, which registers the root's pre-backward on the outputs.
    state.handles.append(model.register_forward_hook(drop_image_outputs, prepend=True))
    state.handles.append(embeddings.register_forward_hook(after))
    return state
