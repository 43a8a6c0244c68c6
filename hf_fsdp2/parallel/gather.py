"""Whole parameters out of a sharded model, one decoder layer at a time: what the vLLM weight syncs send to an engine
(the server's or an in-process one). Every rank calls these in the same order (each DTensor's ``full_tensor`` is a
collective of its mesh), so at most one layer's full parameters are alive at once on any rank."""

from __future__ import annotations

from collections.abc import Iterator

import torch

_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def checkpoint_name(name: str) -> str:
    """A parameter's checkpoint name: without the wrappers' parts (activation checkpointing, compile, FSDP1)."""
    for part in _WRAPPERS:
        name = name.replace(part, "")
    return name


def layer_groups(model: torch.nn.Module) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """The model's parameters by checkpoint name, in gathering order: one group per decoder layer
    (``...layers.<i>.``), the rest (the embeddings, the final norm, the head) in a last group; the same order on
    every rank (``named_parameters``')."""
    groups: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
    for name, param in model.named_parameters():
        clean = checkpoint_name(name)
        parts = clean.split(".")
        key = "rest"
        if "layers" in parts and parts.index("layers") + 1 < len(parts):
            at = parts.index("layers") + 1
            key = ".".join(parts[: at + 1])
        groups.setdefault(key, []).append((clean, param))
    rest = groups.pop("rest", [])
    return [*groups.values(), *([rest] if rest else [])]


def gathered_layers(
    groups: list[list[tuple[str, torch.nn.Parameter]]],
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Each group's full tensors (detached), group after group: every rank iterates the whole of it (collective:
    each sharded parameter's all-gather), whatever it keeps of what it receives."""
    from torch.distributed.tensor import DTensor

    for group in groups:
        yield [
            (name, (param.full_tensor() if isinstance(param, DTensor) else param).detach())
            for name, param in group
        ]
