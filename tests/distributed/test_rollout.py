"""Generation under FSDP2 (GRPO's rollout): 2 gloo ranks, each with its own prompts, batch size and number of new
tokens, generate greedily on the sharded policy exactly what the same weights generate unsharded in one process,
token for token; the rollout all-gathers each FSDP unit once (no collective per token, so ranks that generate
different lengths cannot hang), and the model trains normally after it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.launch import torchrun
from support.tiny import make_tiny_llama_dir

WORKER = Path(__file__).parent / "workers" / "rollout_worker.py"


@pytest.mark.parametrize("gather", ["full", "layer"])
def test_sharded_greedy_generation_equals_one_process_and_gathers_once(tmp_path: Path, gather: str) -> None:
    """``full``: each unit all-gathered at most once per rollout; ``layer`` (rollout_gather: layer): FSDP2's
    per-layer gathers at every token, both ranks decoding in step until both are done (the same count)."""
    model = make_tiny_llama_dir(tmp_path / "model", seed=6)
    torchrun(WORKER, ["--model", str(model), "--out", str(tmp_path), "--gather", gather], nproc=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, report in enumerate(ranks):
        assert report["got"] == report["want"], (rank, report["got"], report["want"])
        if gather == "full":  # at most once per FSDP unit (the root's may still be gathered): not per token
            assert 0 < report["all_gathers"] <= report["units"], report
        else:  # per layer and token: many more, for as many decoding steps as the longest rank's
            assert report["all_gathers"] > 3 * report["units"], report
        assert report["sharded_after"], report
        assert abs(report["loss"] - report["reference_loss"]) < 1e-5 * report["reference_loss"], report
    assert [len(r["got"]) for r in ranks] == [2, 3]
    assert max(ranks[0]["lengths"]) > max(ranks[1]["lengths"])  # rank 0 ran more forwards than rank 1
    assert ranks[0]["all_gathers"] == ranks[1]["all_gathers"]  # the same collectives whatever each generated
