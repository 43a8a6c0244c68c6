"""GRPO's vLLM weight sync and rollouts counted on 2 gloo ranks (tests/distributed/workers/vllm_sync_worker.py): the
server's code over a stand-in engine, so every count is of what the trainer asks of vLLM. Against docs/grpo.md's
formulas ("What a weight sync and a rollout cost"):

- a weight update is one all-gather per FSDP unit, in the engine's dtype (bf16 here: half the bytes of the fp32
  master weights), equal on every rank, counted where torch dispatches them; each of the server's workers receives
  every tensor over the weight group (one broadcast per unit), none over HTTP (the update's request is metadata);
- a generation batch is one engine call of its B/G unique prompts with n = G, not one call per rank of B prompts;
  an evaluation's per-rank prompts (one rank has none) are one call too;
- colocate: sleep level 2 and two wake-ups around each rollout, no byte copied between host and device, the
  weights loaded in bf16; each rank's engine gets its share in one call, each prompt once."""

from __future__ import annotations

import json
from pathlib import Path

from support.launch import torchrun
from support.tiny import make_tiny_llama_dir

WORKER = Path(__file__).parent / "workers" / "vllm_sync_worker.py"
PROMPTS, G = 3, 4


def test_weight_sync_and_rollouts_are_counted_against_the_formulas(tmp_path: Path) -> None:
    model = make_tiny_llama_dir(tmp_path / "model", seed=4)
    torchrun(WORKER, ["--model", str(model), "--out", str(tmp_path)], nproc=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, r in enumerate(ranks):
        units, gathered = r["formula_units"], r["formula_bytes"]
        # One all-gather per FSDP unit (the embeddings, each decoder layer, the head, the root's norm), not one per
        # parameter, of bf16 bytes.
        assert units == r["fsdp_units"] == 5 < r["params"] == 21, r
        assert r["gather"]["collectives"] == units and r["gather"]["bytes"] == gathered, r["gather"]
        assert r["dispatched_all_gathers"] == [units, gathered], r
        assert gathered < r["numel"] * 4 * 0.51 and r["gather"]["host_bytes"] == 0  # bf16: half of fp32
        assert r["gather_equal"], rank
        sync = r["sync"]
        assert r["sync_dispatched_all_gathers"] == [units, gathered], r
        assert (sync["all_gathers"], sync["gathered_bytes"], sync["host_bytes"]) == (units, gathered, 0), sync
        # Rank 0 alone sends: one request, one broadcast per unit of every parameter's bf16 bytes.
        want = (1, units, r["numel"] * 2) if rank == 0 else (0, 0, 0)
        assert (sync["requests"], sync["broadcasts"], sync["broadcast_bytes"]) == want, sync
        assert r["rollout_equal"] and r["rollout_logps"], rank
        assert r["eval_count"] == (2 if rank == 0 else 0)
        assert r["client_engine_calls"] == ([2, PROMPTS + 2] if rank == 0 else [0, 0]), r
        counted = r["counted"]  # the run's rollout/engine_* and rollout/sync_* totals
        assert (counted["engine_calls"], counted["engine_prompts"]) == (
            (2, PROMPTS + 2) if rank == 0 else (0, 0)
        )
        assert (counted["all_gathers"], counted["gathered_bytes"], counted["host_bytes"]) == (
            units,
            gathered,
            0,
        )
        assert counted["broadcast_bytes"] == (r["numel"] * 2 if rank == 0 else 0)
        # Colocate: level 2, weights woken and loaded, then the KV cache; no host copy; one call per rollout.
        assert r["colocate_events"] == ["sleep2", *["wake:weights", "wake:kv_cache", "sleep2"] * 2], r
        assert r["colocate_host_bytes"] == 0 and r["colocate_weights_equal"] and r["colocate_loads"] == 2, r
        assert r["colocate_equal"], rank
        assert r["colocate_sync"]["all_gathers"] == units, r
    assert ranks[0]["dispatched_all_gathers"] == ranks[1]["dispatched_all_gathers"]
    server = ranks[0]
    assert all(server["workers_equal"]) and len(server["workers_equal"]) == 2
    # The generation batch: one engine call, each unique prompt once with n = G; then the evaluation's call.
    rollout, evaluation = server["server_calls"]
    assert len(rollout["prompts"]) == PROMPTS and rollout["n"] == [G] * PROMPTS, rollout
    assert evaluation["prompts"] == [[20, 21], [22]] and evaluation["n"] == [1, 1], evaluation
    assert server["server_resets"] >= 3  # the update's, then each rollout's fresh cache
    paths = [p for p, _ in server["http"]]
    assert paths == ["/weights/group", "/weights/update", "/generate", "/generate"], paths
    update_body = dict(server["http"])["/weights/update"]
    assert update_body < 10_000 < server["numel"] * 2, update_body  # names and shapes, no weights
    # Each rank's colocated engine: its 6 completions in one call, the group split between ranks in two parts.
    assert [c["n"] for c in ranks[0]["colocate_calls"]] == [[4, 2], [4, 2]]
    assert [c["n"] for c in ranks[1]["colocate_calls"]] == [[2, 4], [2, 4]]
