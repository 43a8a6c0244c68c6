"""Collectives counted where torch dispatches them (a ``TorchDispatchMode``): every c10d op and functional collective
a block runs on this rank, with the bytes of its output, whoever issues it (FSDP2, DTensor's ``full_tensor``, a
direct ``all_gather_into_tensor``). A check that counts the library's own counters against these cannot be fooled
by the counters."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Tensor all-gathers (FSDP2's, full_tensor's, a direct all_gather_into_tensor); not c10d.allgather_, the list form
# all_gather_object and the host group's agreements use.
ALL_GATHERS = ("_allgather_base_", "all_gather_into_tensor", "allgather_into_tensor_coalesced_")


def _bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_bytes(v) for v in value)
    return 0


class CommCounter(TorchDispatchMode):
    """``ops``: (name, output bytes) of each collective, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        space = func.namespace
        if space in ("c10d", "_c10d_functional"):
            name = func.overloadpacket.__name__
            if name != "wait_tensor":
                # c10d's in-place ops write their first argument; the functional ones return their output.
                self.ops.append((name, _bytes(args[0]) if space == "c10d" else _bytes(out)))
        return out

    def all_gathers(self) -> tuple[int, int]:
        """How many all-gathers ran and the bytes they produced."""
        hits = [b for n, b in self.ops if n in ALL_GATHERS]
        return len(hits), sum(hits)
