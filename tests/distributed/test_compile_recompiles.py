"""2-rank gloo, real data: chat records of mixed lengths, so every step has a new token count and a new
number of target rows (the chunked loss's loop count), with an eval pass and generation between steps.
Under each compile scope, padding-free and padded: the whole model recompiles at most twice in its first two
steps, neither scope after the first step (1 of slack), and the same losses as eager. With a loss hook whose
closure dynamo guarded on the step's target count, the whole-model scope recompiled every step until dynamo's limit,
then silently ran eagerly; with only the model's inputs marked dynamic, it recompiled 8 times in its first two
steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.launch import torchrun
from support.numerics import assert_same_maths
from support.tiny import make_tiny_llama_dir, write_chat_jsonl

WORKER = Path(__file__).parent / "workers" / "recompile_worker.py"
# cppf: context parallel over the 2 ranks (one padding-free batch, each rank half of every row; the all-to-all inside
# each compiled layer), under regional compile, the GPU default.
# tp: tensor parallel over the 2 ranks (sequence parallel: DTensor redistributions inside each compiled layer; padded
# rows of even length, the run's own padding), under regional compile; eval and generation keep the stream whole.
COMPILED = ["model:pf", "model:padded", "regional:pf", "regional:padded", "regional:cppf", "regional:tp"]
CONFIGS = ["eager:pf", "eager:padded", "eager:cppf", "eager:tp", *COMPILED]
STEPS, EVAL_AFTER = 3, 1  # steps 1, the eval and generation, step 2: new shapes after the warm-up
# Both scopes compile in step 0 (regional: each layer's sequence dims marked dynamic before it).
# The whole model compiles its frames (those between FSDP2's graph breaks, started on tensors eager code hands them)
# shape-generic from the first compile: 2 recompiles in step 0, both at transformers' deprecate_kwarg wrapper,
# one code object shared by the causal LM's and the model's forwards and create_causal_mask (dynamo caches per code
# object; hf_fsdp2.parallel.compiling.compile_model says why they remain). Were the model's inputs alone marked,
# every later frame recompiled once on the second length: 8 in the first two steps. After step 0:
# 0 recompiles measured (torch 2.13) but regional:cppf's 1 in step 1; a bound of 1 for that and for a guard another
# torch adds; more means shapes are being chased again (a hook closure guarded per step: every step, up to the limit).
WARMUP_STEPS = 1
MAX_RECOMPILES_FIRST_TWO_STEPS = 2  # the whole model's
MAX_RECOMPILES_AFTER_WARMUP = 1
# dynamo's guards, graph breaks and recompiles do not depend on the backend; aot_eager (AOT autograd without code
# generation) keeps the regional configs near a minute on 2 cores, where inductor's C++ builds take minutes per config.
# Inductor's numerics against eager: tests/distributed/test_perf_modes.py and tests/recipes/test_perf_recipe.py.
BACKEND = "aot_eager"
# The whole model runs dynamo alone (backend "eager"): its shape-generic decoder-layer frame (dynamic=True makes
# every size and float symbolic) took 34 s of AOT tracing per layout under aot_eager, in two attempts (the first fails
# in AOT's float tensorification and restarts), 2/3 of this file's time. Measured the same under both backends (torch
# 2.13, model:padded): 2 recompiles, all in step 0, 5 graphs, eager's losses. Without dynamic=True the whole model
# still recompiles 13 times here. AOT autograd under compile: the regional configs.
WHOLE_MODEL_BACKEND = "eager"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("recompiles")
    model = make_tiny_llama_dir(root / "model", seed=7)
    data = write_chat_jsonl(root / "chat.jsonl", 32, seed=4)
    out = root / "results.json"
    args = ["--model", str(model), "--data", str(data), "--out", str(out), "--configs", ",".join(CONFIGS)]
    args += ["--steps", str(STEPS), "--eval_after", str(EVAL_AFTER), "--backend", BACKEND]
    args += ["--whole_model_backend", WHOLE_MODEL_BACKEND]
    # 8 configurations' compiles in one launch: on a loaded 2-core machine it passed 600 s (load average 15-19).
    torchrun(WORKER, args, nproc=2, timeout=1200)
    return json.loads(out.read_text())


def test_the_data_changes_shapes_every_step(results):
    for layout in ("pf", "padded", "cppf"):
        run = results[f"eager:{layout}"]
        assert len(set(run["targets"])) == STEPS, run["targets"]  # a new chunk-loop count every step
        assert len(set(run["tokens"])) >= STEPS - 1, run["tokens"]  # (this rank's) token count changes too


@pytest.mark.parametrize("config", COMPILED)
def test_no_recompile_after_warmup_and_the_limit_is_never_hit(results, config):
    compile_rows = results[config]["compile"]  # one per step, and one more after the eval + generation
    warm = compile_rows[WARMUP_STEPS - 1]
    last = compile_rows[-1]
    assert compile_rows[0]["compile_s"] > 0 and warm["compiled_graphs"] >= 1
    assert last["recompiles"] - warm["recompiles"] <= MAX_RECOMPILES_AFTER_WARMUP, compile_rows
    assert last["recompile_limit_hits"] == 0, compile_rows
    eval_row = compile_rows[EVAL_AFTER + 1]  # eval and generation run eagerly: nothing compiled for them
    assert (
        eval_row["compile_s"] == 0
        and eval_row["compiled_graphs"] == compile_rows[EVAL_AFTER]["compiled_graphs"]
    )


@pytest.mark.parametrize("config", [c for c in COMPILED if c.startswith("model:")])
def test_whole_model_recompiles_at_most_twice_in_its_first_two_steps(results, config):
    """Two lengths (steps 0 and 1): the whole model recompiles at most twice, both in step 0 (the deprecation
    wrapper's shared code object), and compiles nothing in step 1: not once per frame between FSDP2's graph breaks
    (8 recompiles, 5 more graphs in step 1, with only the model's inputs marked dynamic)."""
    compile_rows = results[config]["compile"]
    assert compile_rows[1]["recompiles"] <= MAX_RECOMPILES_FIRST_TWO_STEPS, compile_rows
    assert compile_rows[1]["compiled_graphs"] == compile_rows[0]["compiled_graphs"], compile_rows


@pytest.mark.parametrize("config", COMPILED)
def test_same_losses_as_eager(results, config):
    layout = config.split(":")[1]
    ref, run = results[f"eager:{layout}"], results[config]
    assert run["targets"] == ref["targets"]
    # float64 model; Llama's RMSNorm and rotary tables compute in fp32 whatever the dtype, and a backend may fuse
    # them differently: fp32 rounding over the longest of those reductions (the 128-wide MLP).
    assert_same_maths(
        torch.tensor(run["loss_sums"], dtype=torch.float64),
        torch.tensor(ref["loss_sums"], dtype=torch.float64),
        terms=128,
        rounding=torch.float32,
        name=f"{config} step losses",
    )
    assert run["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-4)
