"""Ring context parallel's layout against torch's own ``context_parallel`` on 2 gloo ranks (CPU): what torch shards
in place is what :func:`~hf_fsdp2.parallel.ring.shard_ring` cut on the host (ids and positions), torch's unshard of
the host parts gives the whole batch back, ``ring_context`` enters torch's context (its layout check passing), and
SDPA inside it on CPU fails for the reason ``cp_backend: ring`` is refused on CPU (ring attention itself: CUDA only,
tests/gpu/test_gpu_checks.py::test_ring_cp)."""

from __future__ import annotations

import json
from pathlib import Path

from support.launch import torchrun

WORKER = Path(__file__).parent / "workers" / "ring_layout_worker.py"


def test_the_host_layout_is_torchs_context_parallel_layout(tmp_path: Path) -> None:
    torchrun(WORKER, [str(tmp_path)], nproc=2)
    ranks = json.loads((tmp_path / "result.json").read_text())
    assert [r.get("error") for r in ranks] == [None, None]
    for rank, result in enumerate(ranks):
        assert result["local_rank"] == rank
        for width in (8, 24, 40):
            assert result[f"width{width}"] == {
                "ids_equal": True,
                "positions_equal": True,
                "unshard_equal": True,
            }
        assert result["context_entered"] is True
        # The refusal's premise, as this torch states it (RING_CPU_REFUSAL quotes it).
        assert "_scaled_dot_product_flash_attention_for_cpu" in result["cpu_sdpa_error"], result[
            "cpu_sdpa_error"
        ]
