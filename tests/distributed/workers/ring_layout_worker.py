"""Worker for tests/distributed/test_ring_layout.py (2 gloo ranks, CPU): the ring backend's host layout against torch's
own ``context_parallel`` on the cp mesh. Each rank records: torch's in-place shard of a batch (``context_parallel``'s
buffers) next to :func:`shard_ring`'s; torch's ``context_parallel_unshard`` of the host parts (its restore indices)
next to the whole batch; whether :func:`ring_context` (torch's context with its layout check) was entered; and the
error SDPA raises inside it on CPU tensors (the reason ``cp_backend: ring`` is refused on CPU). Rank 0 writes
``<out>/result.json``.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import context_parallel_unshard

from hf_fsdp2.parallel.ring import ring_context, shard_ring


def run(rank: int) -> dict[str, object]:
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    out: dict[str, object] = {"local_rank": mesh.get_local_rank()}
    for width in (8, 24, 40):
        ids = torch.arange(3 * width).view(3, width) + 1
        batch = {"input_ids": ids, "labels": ids.clone()}
        mine = shard_ring(batch, 2, rank)
        theirs, places = ids.clone(), torch.arange(width).expand(3, width).clone()
        with context_parallel(
            mesh, buffers=[theirs, places], buffer_seq_dims=[1, 1], no_restore_buffers={theirs, places}
        ):
            pass
        (back,) = context_parallel_unshard(mesh, [mine["input_ids"]], [1])
        out[f"width{width}"] = {
            "ids_equal": torch.equal(theirs, mine["input_ids"]),
            "positions_equal": torch.equal(places, mine["position_ids"]),
            "unshard_equal": torch.equal(back, ids),
        }
    q = torch.randn(1, 2, 8, 4)
    try:
        with ring_context(mesh):
            out["context_entered"] = True
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
        out["cpu_sdpa_error"] = None
    except Exception as err:  # noqa: BLE001  # recorded: the test reads it
        out["cpu_sdpa_error"] = f"{type(err).__name__}: {err}"
    return out


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        result = run(rank)
    except Exception:  # noqa: BLE001
        result = {"error": traceback.format_exc()}
    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(sys.argv[1], "result.json").write_text(json.dumps(gathered))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
