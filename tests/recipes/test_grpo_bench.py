"""bench/grpo_bench.py on CPU: its figures' arithmetic from a run's metrics.jsonl, the plan of both
backends with vLLM absent (the GPU image has none: said, with the fix, and the transformers side still planned), its
recipe keys accepted by the grpo recipe, and --smoke: the recipe itself through torchrun, one CPU process, 2 steps."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from support.launch import REPO, python
from test_benches import load_bench, served


def test_figures_leave_out_the_warmup_and_the_rollout_from_training_tokens_per_s(tmp_path: Path) -> None:
    bench = load_bench("grpo_bench")
    rows = [{"step": 1, "step_time_s": 9.0, "tokens": 100, "rollout/generate_s": 8.0, "rollout/weight_sync_s": 0.5,
             "rollout/completion_tokens": 64},
            {"step": 2, "step_time_s": 4.0, "tokens": 300, "rollout/generate_s": 2.0, "rollout/weight_sync_s": 0.5,
             "rollout/completion_tokens": 64},
            {"step": 3, "step_time_s": 6.0, "tokens": 300, "rollout/generate_s": 3.0, "rollout/weight_sync_s": 1.5,
             "rollout/completion_tokens": 96}]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text(
        "\n".join(json.dumps(r) for r in [{"step": 0, "eval_loss": 1.0}, *rows])
    )
    (tmp_path / "summary.json").write_text(json.dumps({"peak_memory_gib": 1.5, "peak_memory_kind": "cuda"}))
    got = bench.figures(tmp_path, warmup=1)
    assert got["steps_timed"] == 2 and got["step_s"] == pytest.approx(5.0)
    assert got["generation_tokens_per_s"] == pytest.approx(160 / 5.0)  # the sync is not generation
    assert got["weight_sync_s_per_step"] == pytest.approx(1.0)
    assert got["training_tokens_per_s"] == pytest.approx(600 / (10.0 - 5.0 - 2.0))
    with pytest.raises(RuntimeError, match="no step after --warmup 3"):
        bench.figures(tmp_path, warmup=3)
    assert "engine_calls_per_step" not in got and "| - |" in bench.table([{"backend": "t", **got}])
    # A vLLM run's counts (timing.py's VLLM_COUNTS) go beside its seconds, per step.
    counts = {
        "rollout/engine_calls": 1,
        "rollout/engine_prompts": 8,
        "rollout/sync_all_gathers": 35,
        "rollout/sync_gathered_bytes": 16e9,
        "rollout/sync_broadcast_bytes": 16e9,
        "rollout/sync_host_bytes": 0,
    }
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps({**r, **counts}) for r in rows))  # fmt: skip
    got = bench.figures(tmp_path, warmup=1)
    assert got["engine_prompts_per_step"] == 8 and got["sync_all_gathers_per_step"] == 35
    assert "| 1.0, 8.0, 35.0, 16.00, 16.00, 0 |" in bench.table([{"backend": "vLLM server", **got}])


def test_dry_run_plans_both_backends_and_says_vllm_is_absent(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    python(
        REPO / "bench" / "grpo_bench.py",
        ["--dry-run", "--vllm-python", str(tmp_path / "no" / "python"), "--procs", "8", "--out", str(out)],
    )
    hf, vllm = json.loads(out.read_text())["results"]
    assert "--nproc_per_node 8" in hf["command"] and "recipes/grpo.py" in hf["command"]
    assert vllm["backend"] == "vLLM server" and "command" not in vllm
    assert "vLLM is not installed here" in vllm["not_run"] and "scripts/setup_vllm.sh" in vllm["not_run"]
    # The keys it launches with are the grpo recipe's (a wrong key would only fail on the GPU node).
    from hf_fsdp2.methods import parse_method_config

    bench = load_bench("grpo_bench")
    args = bench.parse_args(["--procs", "8"])
    cfg = parse_method_config("grpo", bench.recipe_args(args, "m", "d.jsonl", str(tmp_path / "o")))
    assert cfg.method.num_generations == 8 and cfg.method.max_completion_length == 512
    per_rank = cfg.train.per_device_train_batch_size * cfg.train.gradient_accumulation_steps
    assert per_rank * 8 == 8 * 8  # 8 prompts x 8 completions over 8 ranks
    with pytest.raises(SystemExit):
        bench.parse_args(["--backends", "hf,sglang"])
    # colocate: the recipe itself with the vLLM environment's Python, vllm_mode colocate, keys the recipe takes.
    args = bench.parse_args(["--backends", "colocate", "--dry-run", "--vllm-python", sys.executable])
    row = bench.run_backend(args, "colocate", "m", "d.jsonl", tmp_path)
    assert row["backend"] == "vLLM colocate" and row["command"].startswith(
        sys.executable + " -m torch.distributed.run"
    )
    assert "--use_vllm true --vllm_mode colocate --vllm_gpu_memory_utilization 0.3" in row["command"]
    extra = bench.COLOCATE + ["--vllm_gpu_memory_utilization", "0.3"]
    cfg = parse_method_config("grpo", bench.recipe_args(args, "m", "d.jsonl", str(tmp_path / "c")) + extra)
    assert cfg.method.vllm_mode == "colocate" and cfg.train.on_collapse == "warn"
    # The server on a GPU needs one of its own (NCCL: one rank of the weight group per GPU): said, nothing started.
    args = bench.parse_args(["--backends", "vllm", "--vllm-python", sys.executable])
    row = bench.run_backend(args, "vllm", "m", "d.jsonl", tmp_path)
    assert (
        "the server needs a GPU of its own" in row["not_run"] and "--backends colocate" in row["not_run"]
    ), row


@pytest.mark.skipif(sys.platform != "linux", reason="torchrun with gloo on Linux")
def test_smoke_runs_the_recipe_and_reports_generation_and_training_tokens_per_s(tmp_path: Path) -> None:
    out = tmp_path / "smoke.json"
    # The driver here, its torchrun of the recipe forked from the launch server (test_benches.served).
    status = load_bench("grpo_bench").main(
        ["--smoke", "--work", str(tmp_path / "w"), "--out", str(out)], run=served
    )
    (row,) = json.loads(out.read_text())["results"]
    assert "error" not in row and status == 0, row.get("log_tail")
    assert row["backend"] == "transformers generate" and row["steps_timed"] == 2
    # A random model never ends early: every step samples 2 prompts x 2 completions x 4 tokens.
    assert row["completion_tokens_per_step"] == 16
    assert row["generation_tokens_per_s"] > 0 and row["training_tokens_per_s"] > 0
    assert row["step_s"] > row["generate_s_per_step"] > 0 and row["weight_sync_s_per_step"] == 0
