"""The formulas the GPU checks hold their benches to (tests/support/count_formulas.py) against counts the same benches measured
on CPU (gloo), so that a GPU run that counts something else fails on the GPU path itself, not on the formula.

Measured with (this 2-core machine, 2026-12-06):
- ``python bench/gpu_bench_parallel.py --shape tiny --seq 256 --tp 2 --procs 4 --cpu --warmup 1 --steps 1 --ac
  none|full`` (2 layers, 1 loss chunk), and the same with the tiny shape's ``num_hidden_layers`` 3 (at ``--seq 256``
  and ``--seq 9000``: 3 chunks of 4096 targets);
- ``python bench/grpo_bench.py --backends colocate --cpu --shape tiny --procs 1 --steps 3 --warmup 1 --prompts 2
  --generations 2 --completion 4 --prompt-tokens 8`` (.venv-vllm's vLLM 0.32 on CPU, fp32 engine);
- ``python bench/moe_bench.py ep --procs 2 --eps 1,2 --hidden 64 --inter 64 --layers 2 --experts 4 --top-k 2
  --vocab 256 --rows 2 --length 64 --steps 4 --warmup 1``: the GPU check's command.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
from support import count_formulas as formulas

REPO = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# (layers, loss chunks, ac) -> the step's collectives on rank 0, as the bench printed them
TP_MEASURED = {
    (2, 1, "none"): {"all_gather": 17, "reduce_scatter": 12, "all_reduce": 9},
    (2, 1, "full"): {"all_gather": 21, "reduce_scatter": 14, "all_reduce": 9},
    (3, 1, "none"): {"all_gather": 23, "reduce_scatter": 17, "all_reduce": 11},
    (3, 1, "full"): {"all_gather": 29, "reduce_scatter": 20, "all_reduce": 11},
    (3, 3, "full"): {"all_gather": 31, "reduce_scatter": 20, "all_reduce": 11},
}


@pytest.mark.parametrize("shape", sorted(TP_MEASURED))
def test_tp_formula_is_what_the_bench_counted_on_cpu(shape: tuple[int, int, str]) -> None:
    assert formulas.tp_step_collectives(*shape) == TP_MEASURED[shape]


def test_tp_formula_of_the_gpu_check() -> None:
    # Llama-3.2-1B's 16 layers, 8,192-token rows (2 chunks), full checkpointing: the GPU check's expectation.
    got = formulas.tp_step_collectives(16, 2, "full")
    assert got == {"all_gather": 134, "reduce_scatter": 98, "all_reduce": 37}


def test_ep_formula_is_what_moe_bench_counted_on_cpu() -> None:
    import argparse

    import torch

    bench = _load("bench_moe_bench", REPO / "bench" / "moe_bench.py")
    shape = argparse.Namespace(
        hidden=64, inter=64, layers=2, experts=4, top_k=2, vocab=256, rows=2, length=64
    )
    with torch.device("meta"):  # shapes only
        model = bench._bench_model(shape)
    tokens = shape.rows * shape.length
    flat = formulas.ep_step_bytes(model, ranks=2, ep=1, tokens=tokens)
    ep = formulas.ep_step_bytes(model, ranks=2, ep=2, tokens=tokens)
    # Exact: FSDP2's gathers and reductions; flat FSDP2 sends no all-to-all.
    assert flat == {"all_gather_single": 594048, "reduce_scatter_single": 329856}
    assert (ep["all_gather_single"], ep["reduce_scatter_single"]) == (200832, 133248)
    assert ep["all_to_all_single"] == 262176  # balanced routing
    # What the bench counted passes the GPU check's test (the exchange under random routing: 1.06x balanced) ...
    measured = {
        1: {"all_gather_single": 594048, "reduce_scatter_single": 329856},
        2: {"all_gather_single": 200832, "reduce_scatter_single": 133248, "all_to_all_single": 277194},
    }
    expected = {1: flat, 2: ep}
    assert formulas.ep_failures(measured, expected) == []
    # ... and a count off its formula fails it: the experts gathered again under ep, an exchange under flat FSDP2,
    # the exchange doubled (or in fp32 where bf16 was meant).
    gathered = {**measured, 2: {**measured[2], "all_gather_single": measured[1]["all_gather_single"]}}
    assert formulas.ep_failures(gathered, expected) == [
        "ep 2: all_gather_single 594048 bytes, formula 200832"
    ]
    exchanged = {**measured, 1: {**measured[1], "all_to_all_single": 8}}
    assert formulas.ep_failures(exchanged, expected) == ["flat FSDP2 sent 8 bytes by all-to-all"]
    doubled = {**measured, 2: {**measured[2], "all_to_all_single": 2 * 277194}}
    assert formulas.ep_failures(doubled, expected) == ["ep 2: all-to-all 554388 bytes, 2.11x balanced"]
    with pytest.raises(ValueError, match="ep 3"):
        formulas.ep_step_bytes(model, ranks=4, ep=3, tokens=tokens)


def test_rollout_formula_is_what_the_colocate_bench_counted_on_cpu() -> None:
    # Steps 2 and 3 of the run (the tiny tied Llama: 2 layers, 4 FSDP units, 2,122,048 parameters, fp32 engine): 1
    # engine call of the 2 unique prompts (2 x 2 completions), 4 all-gathers of 8,488,192 bytes, no host bytes.
    want = formulas.rollout_counts(prompts=2, procs=1, units=4, params=2122048, itemsize=4)
    assert want == {
        "engine_calls": 1,
        "engine_prompts": 2,
        "all_gathers": 4,
        "gathered_bytes": 8488192,
        "host_bytes": 0,
    }
    # grpo_bench's row of that run (per step after the warm-up) passes the GPU check's test...
    row = {
        "engine_calls_per_step": 1.0,
        "engine_prompts_per_step": 2.0,
        "sync_all_gathers_per_step": 4.0,
        "sync_gathered_bytes_per_step": 8488192.0,
        "sync_broadcast_bytes_per_step": 0.0,
        "sync_host_bytes_per_step": 0.0,
    }
    assert formulas.rollout_failures(row, want, broadcast=0) == []
    # ... and what the path before this work counted fails it: one request of every completion (B prompts), one
    # all-gather per parameter tensor (20) in fp32 staged through host memory; a server that was sent nothing.
    before = {
        **row,
        "engine_prompts_per_step": 4.0,
        "sync_all_gathers_per_step": 20.0,
        "sync_host_bytes_per_step": 8.5e6,
    }
    assert len(formulas.rollout_failures(before, want, broadcast=0)) == 3
    assert formulas.rollout_failures(row, want, broadcast=8488192) == [
        "sync_broadcast_bytes_per_step 0.0, formula 8488192"
    ]
