"""GRPO with ``vllm_mode: colocate``: a vLLM engine inside each of 2 gloo ranks, launched with
.venv-vllm's Python (vLLM pins transformers<5.20; scripts/setup_vllm.sh installs the trainer's dependencies there).
One straight run and one resumed run serve every assertion: the weights are loaded into each rank's engine before
every rollout and probed, vLLM samples what the policy would (the correction's ratios ~1), the run trains, and the
run resumed from checkpoint-2 repeats step 3 exactly. Skipped, with the reason, without .venv-vllm."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from support.launch import REPO, free_port
from support.tiny import WORDS
from support.vllm_models import NO_VLLM, VLLM_PYTHON, tiny_vllm_llama

from hf_fsdp2.observe.logs import read_metrics

GRPO = REPO / "recipes" / "grpo.py"
# slow: two launches, each ~60 s of vLLM import and ~60 s of engine start per rank here (224 s at load ~6).
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not VLLM_PYTHON.exists(),
        reason=NO_VLLM,
    ),
]


def _model(folder: Path) -> Path:
    return tiny_vllm_llama(folder, tied=True)


def _launch(root: Path, out: Path, *extra: str) -> str:
    """torchrun of the GRPO recipe with .venv-vllm's Python (hf_fsdp2 from this checkout); its log."""
    args = [
        "--model_name_or_path",
        str(root / "model"),
        "--dataset_name",
        str(root / "prompts.jsonl"),
        "--output_dir",
        str(out),
        "--max_steps",
        "3",
        "--per_device_train_batch_size",
        "4",
        "--num_generations",
        "4",
        "--max_completion_length",
        "8",
        "--max_length",
        "64",
        "--mixed_precision",
        "no",
        "--learning_rate",
        "1e-2",
        "--lr_scheduler_type",
        "constant",
        "--logging_steps",
        "1",
        "--seed",
        "0",
        "--reward_funcs",
        "colocate_rewards:spread",
        "--temperature",
        "0.9",
        "--use_vllm",
        "true",
        "--vllm_mode",
        "colocate",
        "--save_steps",
        "1",
        "--export_verify",
        "false",
        *extra,
    ]
    cmd = [
        str(VLLM_PYTHON),
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(GRPO),
        *args,
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), str(root)]),
    }
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    return log


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("grpo_colocate")
    _model(root / "model")
    rng = random.Random(5)
    with (root / "prompts.jsonl").open("w") as fh:
        for _ in range(16):
            fh.write(json.dumps({"prompt": " ".join(rng.choices(WORDS, k=rng.randint(2, 7)))}) + "\n")
    (root / "colocate_rewards.py").write_text(
        "def spread(prompts, completions, **kw):\n    return [float(len(set(c)) % 3) for c in completions]\n"
    )
    straight, resumed = root / "straight", root / "resumed"
    straight_log = _launch(root, straight)
    resumed.mkdir()
    shutil.copytree(straight / "checkpoint-2", resumed / "checkpoint-2")
    (resumed / "latest").write_text("2\n")
    resumed_log = _launch(root, resumed, "--resume_from_checkpoint", "latest")
    return {
        "straight": read_metrics(straight / "metrics.jsonl"),
        "resumed": read_metrics(resumed / "metrics.jsonl"),
        "straight_log": straight_log,
        "resumed_log": resumed_log,
    }


def test_colocate_loads_the_weights_into_each_ranks_engine_before_every_rollout_and_trains(runs) -> None:  # type: ignore[no-untyped-def]
    log = str(runs["straight_log"])
    assert "vLLM colocate: 2 engine(s) of tensor parallel size 1 over 2 processes" in log, log[-3000:]
    assert "rollouts: vLLM in each training process (vllm_mode colocate, float32, tensor parallel 1" in log
    # vllm_enable_sleep_mode unset: the run's choice, said once (on CPU: no sleep mode to choose).
    assert "vLLM colocate sleep mode: off (no GPU: vLLM's CPU backend has no sleep mode)" in log
    for version in (
        1,
        2,
        3,
    ):  # one load per optimizer update (an all-gather per sharded FSDP unit), each probed
        # (the embeddings, 2 layers, the root's norm; at the first load the root and the embeddings are still
        # unsharded after a forward without gradient: 2 all-gathers)
        assert re.search(
            rf"vLLM weights version {version}: 20 tensors in 4 units \(\d all-gathers in float32\) loaded into each "
            "rank's engine",
            log,
        ), log[-3000:]
        assert f"vLLM weights version {version}: probe passed on every rank's engine" in log
    rows = runs["straight"]
    assert [r["step"] for r in rows] == [1, 2, 3]  # type: ignore[index, union-attr]
    for r in rows:  # type: ignore[union-attr]
        # vLLM samples what the policy would: the correction's ratios are 1 up to float32 rounding.
        assert r["sampling/sampling_logp_difference/max"] < 1e-4, r
        assert abs(r["sampling/importance_sampling_ratio/mean"] - 1) < 1e-4, r
    assert any(r["grad_norm"] > 0 for r in rows)  # type: ignore[union-attr]
    assert rows[0]["completions/min_length"] < rows[0]["completions/max_length"]  # type: ignore[index]


def test_colocate_resumes_exactly(runs) -> None:  # type: ignore[no-untyped-def]
    # The resumed engines start from the model folder: the first rollout loads the checkpoint's policy (version 1).
    assert "vLLM weights version 1: 20 tensors in 4 units" in str(runs["resumed_log"])
    a = {r["step"]: r for r in runs["straight"]}  # type: ignore[union-attr]
    b = {r["step"]: r for r in runs["resumed"]}  # type: ignore[union-attr]
    assert sorted(b) == [3]
    for key in (
        "loss",
        "grad_norm",
        "reward",
        "completions/mean_length",
        "sampling/importance_sampling_ratio/mean",
    ):
        assert a[3][key] == pytest.approx(b[3][key], rel=1e-6, abs=1e-9), (key, a[3][key], b[3][key])
