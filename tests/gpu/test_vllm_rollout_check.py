"""The vLLM rollout checks of `bash scripts/gpu_check.sh`: ``bench/grpo_bench.py`` runs the GRPO recipe with vLLM
colocated in the training process (one GPU) or with the vLLM server on a GPU of its own (2 GPUs: NCCL forbids two
ranks of the weight group on one), and each step's seconds are printed beside what the step counted
(hf_fsdp2/methods/grpo/timing.py, docs/grpo.md "What a weight sync and a rollout cost"): engine calls, prompts
prefilled, the weight load's all-gathers and bytes, bytes broadcast, host bytes.

Both need vLLM: ``.venv-vllm`` (``HF_FSDP2_VLLM_SPEC=vllm bash scripts/setup_vllm.sh`` on a connected GPU node). The
lent GPU image has none and nothing can be fetched there: the checks are skipped with that reason, and their
budgets are reported apart (``needs_vllm_budget_s``). ``--gpu-dry-run`` validates the bench's flags and the recipe
keys it launches with anywhere.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import pytest
import torch
from support.count_formulas import rollout_counts, rollout_failures

from hf_fsdp2.methods import parse_method_config

from .conftest import Check
from .test_gpu_checks import REPO, load_script, run, tail

pytestmark = pytest.mark.gpu

PROMPTS, GENERATIONS, COMPLETION = 8, 8, 128  # B / G unique prompts per step, G completions each
UNITS = re.compile(r"vLLM weights version \d+: \d+ tensors in (\d+) units")


def _vllm_missing(bench: Any) -> str | None:
    """Why vLLM cannot run here (None: it can): no .venv-vllm, or its Python does not import vllm."""
    python, why = bench.vllm_python(None)
    if python is None:
        return str(why)
    probe = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    if probe.returncode:
        return f"{python} does not import vllm: {probe.stderr.strip()[-500:]}"
    return None


def _rollout_check(check: Check, backend: str, procs: int) -> None:
    """``bench/grpo_bench.py --backends <backend>`` on the 1B shape, held to :func:`~support.count_formulas.rollout_counts`."""
    bench = load_script("grpo_bench", REPO / "bench" / "grpo_bench.py")
    out, work = check.work / "grpo.json", check.work / "grpo"
    argv = ["--backends", backend, "--procs", str(procs), "--steps", "4", "--warmup", "1"]
    argv += ["--prompts", str(PROMPTS), "--generations", str(GENERATIONS), "--completion", str(COMPLETION)]
    argv += ["--prompt-tokens", "64", "--timeout-s", str(check.timeout(0.8)), "--work", str(work)]
    args = bench.parse_args([*argv, "--out", str(out)])
    # The keys it launches the recipe with are the grpo recipe's (colocate's own keys with them).
    extra = bench.COLOCATE + ["--vllm_gpu_memory_utilization", "0.3"] if backend == "colocate" else []
    cfg = parse_method_config("grpo", bench.recipe_args(args, "m", "d.jsonl", str(work / "o")) + extra)
    assert cfg.method.num_generations == GENERATIONS
    check.figures["command"] = "python bench/grpo_bench.py " + " ".join(argv)
    if check.dry:
        return
    missing = _vllm_missing(bench)
    if missing:
        pytest.skip(f"needs vLLM (.venv-vllm; the lent GPU image has none): {missing}")
    code, log = run([sys.executable, str(REPO / "bench" / "grpo_bench.py"), *argv, "--out", str(out)],
                    check.work / "bench.log", check.timeout())  # fmt: skip
    assert out.is_file(), f"grpo_bench exit code {code}:\n{tail(log)}"
    (row,) = json.loads(out.read_text())["results"]
    assert "not_run" not in row and "error" not in row, (row.get("not_run") or row.get("log_tail"), tail(log))
    assert code == 0, tail(log)
    run_log = (work / f"run_{backend}.log").read_text(errors="replace")
    units = [int(u) for u in UNITS.findall(run_log)]
    assert units, f"no weight load in the run's log:\n{tail(run_log)}"
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(next(work.glob("llama_*")))  # the folder the run loaded
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    want = rollout_counts(prompts=PROMPTS, procs=1, units=max(units), params=params, itemsize=2)
    keys = ("step_s", "generate_s_per_step", "weight_sync_s_per_step", "generation_tokens_per_s")
    check.figures.update({k: row[k] for k in keys})
    check.figures.update({k: v for k, v in row.items() if k.endswith("_per_step") and k not in keys})
    check.figures["units"] = max(units)
    sleep = re.search(r"vLLM colocate sleep mode: (.*)", run_log)
    check.figures["sleep_mode"] = sleep.group(1) if sleep else None
    # One engine call of the step's unique prompts (not one per rank, not one prefill per completion); the load (the
    # steps after the warm-up one): one all-gather per FSDP unit of every parameter's bf16 bytes, nothing through
    # host memory; the server: every parameter's bf16 bytes broadcast once per update, colocate: none (in place).
    # a unit per decoder layer, the embeddings, the root (a log read wrongly would pass anything)
    assert want["all_gathers"] <= config.num_hidden_layers + 3, units
    failures = rollout_failures(row, want, want["gathered_bytes"] if backend == "vllm" else 0)
    assert not failures, failures


@pytest.mark.budget(150)
@pytest.mark.needs_vllm
def test_vllm_colocate_rollout(check: Check) -> None:
    """GRPO with vLLM colocated in the one training process (``vllm_mode: colocate``): seconds per step, generation
    tokens/s and the weight load's seconds beside the step's counts. Fails when the bench or the run fails, the step
    makes other than 1 engine call or prefills other than its B/G unique prompts, the load makes other than one
    all-gather per FSDP unit or moves other than the parameters' bf16 bytes, or copies through host memory (the
    same bench on CPU, vLLM's CPU backend: tests/unit/test_gpu_formulas.py)."""
    _rollout_check(check, "colocate", 1)


@pytest.mark.budget(180)
@pytest.mark.gpus(2)
@pytest.mark.needs_vllm
def test_vllm_server_rollout(check: Check) -> None:
    """GRPO with the vLLM server on the second GPU (one trainer rank on the first): as the colocate check, and every
    parameter's bf16 bytes broadcast to the server once per update (no HTTP weights, no host copy)."""
    if not check.dry and torch.cuda.device_count() < 2:
        pytest.skip(
            f"needs 2 GPUs (trainer and server: NCCL forbids two ranks of the weight group on one GPU), this node "
            f"has {torch.cuda.device_count()}"
        )
    _rollout_check(check, "vllm", 1)
