"""Counting the collectives a piece of work issues, by kind: what proves on CPU (gloo) what a layout will move on GPUs
(NCCL), and what the GPU benches print next to their seconds.

:class:`CollectiveCounter` is torch's ``CommDebugMode`` (which sees DTensor's redistributions, the functional
collectives FSDP2 and the autograd all-to-all use, and the plain ``torch.distributed`` calls) without its per-module
tracker: transformers 5 runs one function module several times in each attention layer (its rotary helper), and the
tracker's forward-hook bookkeeping does not survive a module called twice (IndexError in ``_fw_set_module_hook``).
The counts are the same; only their attribution to modules is dropped.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch.distributed.tensor.debug import CommDebugMode

# torch's op names -> the kind a reader knows (NCCL's names).
_KINDS = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_to_all_single": "all_to_all",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "shard_dim_alltoall": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}


class _NoModuleTracker:
    """What ``CommDebugMode.__torch_dispatch__`` reads of its module tracker, with every collective at the top."""

    name = "Global"
    is_bw = False
    activation_checkpointing = False
    module_parents_dict: dict[str, set[str]] = {"Global": set()}  # noqa: RUF012  # read only

    def __enter__(self) -> _NoModuleTracker:
        return self

    def __exit__(self, *args: Any) -> None:
        return None


class CollectiveCounter(CommDebugMode):
    """``with CollectiveCounter() as counter: ...`` then ``counter.counts()``: the collectives issued in the block on
    this rank, by kind (``all_gather``, ``reduce_scatter``, ``all_reduce``, ``all_to_all``, ``broadcast``, others by
    torch's name). Counts one call per collective, whatever its group or size."""

    def __init__(self) -> None:
        super().__init__()
        self.advanced_module_tracker = _NoModuleTracker()  # type: ignore[assignment]

    def counts(self) -> dict[str, int]:
        """The block's collectives by kind (kinds with none left out)."""
        out: Counter[str] = Counter()
        for op, n in self.get_comm_counts().items():
            name = str(getattr(op, "__name__", op)).rsplit(".", 1)[-1]
            out[_KINDS.get(name, name)] += n
        return dict(out)


def describe_counts(counts: dict[str, int]) -> str:
    """``"2 all_gather + 2 reduce_scatter"`` (kinds sorted; ``"none"`` when empty)."""
    return " + ".join(f"{n} {kind}" for kind, n in sorted(counts.items()) if n) or "none"
