"""The checks of `bash scripts/gpu_check.sh`, one test each, on one CUDA GPU (one H200: 8 minutes in all).

Nothing downloaded: the models are random-init Llamas built from configs (tests/gpu/assets.py: a tiny tied /
untied pair with a byte-level BPE tokenizer trained in code, and the Llama-3.2-1B shape), so the checks run on
an air-gapped node. Each recipe check launches the SFT recipe the way users do (``hf-fsdp2 train``'s accelerate
launch line: the packaged fsdp2.yaml, one process: FSDP2 over NCCL at world size 1), with bf16 compute,
regional compile, activation checkpointing and the chunked cross entropy, then reloads the verified export in a
fresh process with plain transformers on the GPU. Each check's docstring says what makes it fail; each has a
budget (``@pytest.mark.budget``, seconds on one H200) printed beside its time, and is stopped at 3x it.

A check's subprocess is stopped (its whole process tree) before the test's own timeout, so one stuck check
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

from hf_fsdp2.launch import launch_command
from hf_fsdp2.methods import parse_method_config
from hf_fsdp2.observe.logs import read_metrics

from .assets import make_model_dir
from .conftest import Check, dry_run
from .tolerances import bf16_loss_tolerance, fp8_probe_figures

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
# Where the checks' processes start: scripts/gpu_check.sh --offline lays the checkout out as installed
# (recipes inside hf_fsdp2) and names it here; `python -m` takes its working folder first on sys.path.
CWD = Path(os.environ.get("HF_FSDP2_CHECKOUT") or REPO)
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
out["reload_device"] = str(next(model.parameters()).device)
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

# The merged QLoRA export vs the dequantised 4-bit base + adapter (plain PEFT), fp32 on the CPU; the adapter on the
# 4-bit base itself. The base is quantised with torchao's NF4 as the run did: 64-weight blocks, the scales per 256 or
# the largest power of two below that divides their count (one GPU, one shard: docs/qlora.md).
QLORA_RELOAD = r"""
import json, sys, torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
base_dir, adapter_dir, merged_dir = sys.argv[1:4]
ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
def base(dequantised):
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            block = 256
            while (module.weight.numel() // 64) % block:
                block //= 2
            w = to_nf4(module.weight.detach().contiguous(), 64, block)
            module.weight = torch.nn.Parameter(w.get_original_weight() if dequantised else w, requires_grad=False)
    return model
with torch.no_grad():
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()(ids).logits
    on_dequantised = PeftModel.from_pretrained(base(True), adapter_dir).eval()(ids).logits
    on_4bit = PeftModel.from_pretrained(base(False), adapter_dir).eval()(ids).logits
print(json.dumps({"merged_vs_peft_max_abs": float((merged - on_dequantised).abs().max()),
                  "nf4_vs_dequantised_max_abs": float((on_4bit - on_dequantised).abs().max()),
                  "logit_scale": float(on_dequantised.abs().max())}))
"""

# ---------------------------------------------------------------------------------------------- helpers


def env(extra: dict[str, str] | None = None) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    out.update(extra or {})
    out.update({"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
    out["PYTHONPATH"] = os.pathsep.join([str(CWD), str(REPO), str(REPO / "tests"), out.get("PYTHONPATH", "")])
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


def run(
    cmd: list[str], log: Path, timeout: float, extra_env: dict[str, str] | None = None
) -> tuple[int | None, str]:
    """Run ``cmd`` with its output to ``log``; it and all its descendants are killed after ``timeout`` (or
    when the test is stopped first). Returns (exit code, None when killed; the output)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as fh:
        proc = subprocess.Popen(
            cmd, cwd=CWD, env=env(extra_env), stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
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


def prepare_recipe(
    check: Check, name: str, values: dict[str, Any], recipe_name: str = "sft"
) -> tuple[Path, list[str]]:
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
    # Unknown keys and bad values fail here, dry run included (the method's own keys with it).
    parse_method_config(recipe_name, ["--config", str(recipe)])
    cmd = launch_command(
        recipe_name, ["--config", str(recipe)], num_processes=1, gpus=1, main_process_port=free_port()
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
    for pattern in (
        r"world size 1 on cuda\S*; mixed precision bf16",
        r"regional compile: \d+ decoder layers",
        rf"activation checkpointing {ac} on \d+ decoder layers",
    ):
        assert re.search(pattern, log), f"{pattern!r} not in the log:\n{tail(log)}"
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = read_metrics(run_dir / "metrics.jsonl")
    keys = (
        "steps",
        "final_loss",
        "tokens_per_s",
        "tflops_per_device",
        "mfu",
        "peak_memory_gib",
        "compile_time_s",
        "recompiles",
        "train_time_s",
        "wall_time_s",
    )
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
    """Reload the export in a fresh process with plain transformers, on the GPU (bf16) and the CPU (fp32)."""
    code, log = run(
        [sys.executable, "-c", RELOAD, str(folder), *extra], folder.parent / "reload.log", timeout
    )
    assert code == 0, f"reload of {folder} failed ({code}):\n{tail(log)}"
    out: dict[str, Any] = json.loads(log.strip().splitlines()[-1])
    check.figures.update({f"reload_{k}": v for k, v in out.items()})
    assert out["finite"] and not out["hf_fsdp2_imported"], out
    assert out["reload_device"].startswith("cuda"), out
    return out


def tiny_model(check: Check, name: str, *, tied: bool) -> Path:
    return make_model_dir(check.work / name, tied=tied, shape="tiny", seed=3)


def tiny_data(check: Check) -> Path:
    from support.tiny import write_chat_jsonl

    return write_chat_jsonl(check.work / "chat.jsonl", 96, seed=5)


TINY_RUN = {
    "max_steps": 8,
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 2,
    "learning_rate": 1e-3,
    "max_length": 128,
    "ce_chunk_tokens": 64,
}


# ---------------------------------------------------------------------------------------------- checks


@pytest.mark.budget(45)
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_sft_tiny(check: Check, tied: bool) -> None:
    """SFT recipe on the tiny tied/untied pair, export verified and reloaded on the GPU. Fails when the recipe
    exits non-zero, its log lacks the GPU path (CUDA, bf16, regional compile, AC) or the export's verification
    line, a loss is NaN, the export changes the tie (``lm_head.weight`` saved when tied or missing when not),
    or CUDA bf16 logits differ from CPU fp32 ones by over 10% of the logit scale."""
    model = tiny_model(check, "model", tied=tied)
    run_dir, cmd = prepare_recipe(
        check, "sft", {"model_name_or_path": str(model), "dataset_name": str(tiny_data(check)), **TINY_RUN}
    )
    if check.dry:
        return
    log = launch(check, cmd, run_dir, timeout=check.timeout(0.7))
    run_figures(check, run_dir, log)
    out = reload(check, run_dir, timeout=check.timeout(0.3))
    assert out["tied"] is tied and out["lm_head_saved"] is not tied, out
    # bf16 GPU kernels vs fp32 CPU on the same weights: a bug shows as an O(logit scale) difference.
    assert out["cuda_bf16_vs_cpu_fp32_max_abs"] < 0.1 * max(out["logit_scale"], 1.0), out


@pytest.mark.budget(45)
def test_lora_merge(check: Check) -> None:
    """LoRA trained and merged (fp32 export), reloaded on the GPU. Fails when the adapter files are missing,
    the adapter does not change the model, or merged logits differ from base + adapter (PEFT) by over 1e-3 of
    the logit scale."""
    model = tiny_model(check, "model", tied=False)
    values = {
        "model_name_or_path": str(model),
        "dataset_name": str(tiny_data(check)),
        **TINY_RUN,
        "torch_dtype": "float32",
        "use_peft": True,
        "lora_r": 8,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "merge_adapter": True,
        "export_dtype": "float32",
    }
    run_dir, cmd = prepare_recipe(check, "lora", values)
    if check.dry:
        return
    log = launch(check, cmd, run_dir, timeout=check.timeout(0.7))
    run_figures(check, run_dir, log)
    assert (run_dir / "adapter_config.json").is_file() and (run_dir / "adapter_model.safetensors").is_file()
    merged = run_dir / "merged"
    out = reload(check, merged, timeout=check.timeout(0.3))
    assert out["tied"] is False, out
    code, text = run(
        [sys.executable, "-c", LORA_RELOAD, str(model), str(run_dir), str(merged)],
        run_dir.parent / "lora_reload.log",
        check.timeout(0.3),
    )
    assert code == 0, tail(text)
    lora = json.loads(text.strip().splitlines()[-1])
    check.figures.update(lora)
    # The adapter changed the model, and the merged fp32 weights are base + adapter.
    assert lora["adapter_effect_max_abs"] > 0, lora
    assert lora["merged_vs_peft_max_abs"] < 1e-3 * max(lora["logit_scale"], 1.0), lora


@pytest.mark.budget(40)
def test_qlora_merge(check: Check) -> None:
    """QLoRA on the GPU: the 4-bit NF4 base (torchao) under bf16 mixed precision, the adapter exported and verified by
    the recipe (4-bit and dequantised base), the merged fp32 model. Fails when the run's log lacks the 4-bit bytes
    line or shows more than the 4-bit size on the rank, the merged logits differ from dequantised base + adapter
    (PEFT, fp32 CPU) by over 1e-3 of the logit scale, or the adapter on the 4-bit base differs from it on the
    dequantised base by as much."""
    model = tiny_model(check, "model", tied=False)
    values = {
        "model_name_or_path": str(model),
        "dataset_name": str(tiny_data(check)),
        **TINY_RUN,
        "torch_dtype": "float32",
        "mixed_precision": "bf16",
        "use_peft": True,
        "load_in_4bit": True,
        "lora_r": 8,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "merge_adapter": True,
        "export_dtype": "float32",
    }
    run_dir, cmd = prepare_recipe(check, "qlora", values)
    if check.dry:
        return
    log = launch(check, cmd, run_dir, timeout=check.timeout(0.7))
    run_figures(check, run_dir, log)
    held = re.search(r"4-bit base on this rank after sharding: [\d.]+ MiB \((\d+) bytes\) of (\d+)", log)
    assert held, tail(log)
    check.figures["nf4_bytes_rank0"], check.figures["nf4_bytes"] = int(held.group(1)), int(held.group(2))
    assert int(held.group(1)) <= int(held.group(2)), held.group(0)
    assert "on the 4-bit base (torchao NF4" in log, tail(log)
    code, text = run(
        [sys.executable, "-c", QLORA_RELOAD, str(model), str(run_dir), str(run_dir / "merged")],
        run_dir.parent / "qlora_reload.log",
        check.timeout(0.3),
    )
    assert code == 0, tail(text)
    out = json.loads(text.strip().splitlines()[-1])
    check.figures.update(out)
    assert out["merged_vs_peft_max_abs"] < 1e-3 * max(out["logit_scale"], 1.0), out
    assert out["nf4_vs_dequantised_max_abs"] < 1e-3 * max(out["logit_scale"], 1.0), out


@pytest.fixture(scope="module")
def offload_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One recipe run with activation offload under regional compile, recording a memory snapshot of steps
    2-3 (used by two checks). In a dry run: the validated command only."""
    check = Check(dry_run(request.config), tmp_path_factory.mktemp("offload"), {}, 45.0)
    model = tiny_model(check, "model", tied=False)
    values = {
        "model_name_or_path": str(model),
        "dataset_name": str(tiny_data(check)),
        **TINY_RUN,
        "activation_checkpointing": "offload",
        "memory_snapshot_steps": "2-3",
    }
    run_dir, cmd = prepare_recipe(check, "offload", values)
    result: dict[str, Any] = {"check": check, "run_dir": run_dir, "log": None, "error": None}
    if not check.dry:
        try:
            result["log"] = launch(check, cmd, run_dir, timeout=check.timeout(0.9))
        except (Exception, pytest.fail.Exception) as err:  # both checks report it, with the figures so far
            result["error"] = f"{type(err).__name__}: {err}"
    return result


@pytest.mark.budget(40)
def test_activation_offload(check: Check) -> None:
    """tests/gpu/offload_check.py: ``full`` vs ``offload`` on the same model and rows. Fails when offload moves
    fewer bytes to the host than every layer's input (or ``full`` moves any), its device peak
    (``max_memory_allocated``) is not lower than ``full``'s, the first step's loss differs (the forward is the
    same kernels on the same inputs) or a later step's loss differs by more than the derived bf16 tolerance
    (tests/gpu/tolerances.py)."""
    out = check.work / "offload.json"
    argv = [str(REPO / "tests" / "gpu" / "offload_check.py"), "--out", str(out)]
    code, log = run([sys.executable, *argv, "--dry-run"], check.work / "offload_dry.log", 120)
    assert code == 0, tail(log)  # the flags parse and the library imports, on any machine
    check.figures["command"] = "python " + " ".join(argv[0:1]) + " --out ..."
    if check.dry:
        return
    code, log = run([sys.executable, *argv], check.work / "offload.log", check.timeout())
    assert code == 0 and out.is_file(), f"offload_check exit code {code}:\n{tail(log)}"
    report = json.loads(out.read_text())
    full, off = report["modes"]["full"], report["modes"]["offload"]
    check.figures.update(
        {
            "host_bytes": off["host_bytes"],
            "expected_host_bytes": report["expected_host_bytes"],
            "peak_full_gib": full["peak_bytes"] / 2**30,
            "peak_offload_gib": off["peak_bytes"] / 2**30,
            "peak_saved_mib": (full["peak_bytes"] - off["peak_bytes"]) / 2**20,
            "loss_full": full["losses"][-1],
            "loss_offload": off["losses"][-1],
        }
    )
    assert full["host_bytes"] == 0 and off["host_bytes"] >= report["expected_host_bytes"], check.figures
    assert off["peak_bytes"] < full["peak_bytes"], check.figures
    assert off["losses"][0] == full["losses"][0], (off["losses"], full["losses"])
    for a, b in zip(off["losses"], full["losses"], strict=True):
        assert abs(a - b) <= bf16_loss_tolerance(b, report["layers"]), (off["losses"], full["losses"])


@pytest.mark.budget(45)
def test_memory_snapshot(check: Check, offload_run: dict[str, Any]) -> None:
    """The SFT recipe with ``activation_checkpointing: offload`` under regional compile, recording a CUDA memory
    snapshot of steps 2-3. Fails when the run fails, its log lacks the offload line or the export's
    verification, or the snapshot is missing or holds no segment or trace event."""
    import pickle

    check.figures["command"] = offload_run["check"].figures["command"]
    if check.dry:
        return
    if offload_run["error"]:
        pytest.fail(offload_run["error"], pytrace=False)
    run_figures(check, offload_run["run_dir"], offload_run["log"], ac="offload")
    files = sorted((offload_run["run_dir"] / "profile").glob("memory_snapshot_rank0_steps2-3.pickle"))
    assert files, f"no memory snapshot in {offload_run['run_dir'] / 'profile'}:\n{tail(offload_run['log'])}"
    with files[0].open("rb") as fh:
        snapshot = pickle.load(fh)
    traces = snapshot.get("device_traces") or [[]]
    check.figures.update(
        {
            "snapshot_mb": round(files[0].stat().st_size / 1e6, 2),
            "segments": len(snapshot.get("segments", [])),
            "trace_events": len(traces[0]),
        }
    )
    assert check.figures["segments"] > 0 and check.figures["trace_events"] > 0, check.figures


@pytest.mark.budget(130)
def test_gpu_bench_quick(check: Check) -> None:
    """``bench/gpu_bench.py --quick``: the 1B shape, eager beside regional compile, 2 warm-up + 5 timed steps
    (compile happens in the warm-up, which is not timed). Fails when a runner has no figures (error, OOM,
    budget), regional compile recompiles during the timed steps (dynamo's counters), or the eager and compiled
    losses of a step differ by more than the derived bf16 tolerance (tests/gpu/tolerances.py). FP8: with FP8 tensor
    cores (sm_89+) the regional runner's ``mixed_precision fp8`` twin too: tokens/s of both, no recompile after the
    warm-up, and each warm-up step's FP8 loss within the bound derived from e4m3 rounding of the loss of the same
    forward without float8 casts at the same weights (hf_fsdp2/parallel/float8_bound.py, computed by the runner from
    that reference forward's own tensors; ``fp8_probe_max_ratio`` <= 1). The FP8 trajectory is not compared with
    the bf16 one step by step: after the first update the two runs hold different weights."""
    bench = load_script("gpu_bench", REPO / "bench" / "gpu_bench.py")
    out = check.work / "gpu_bench.json"
    argv = ["--quick", "--out", str(out), "--work", str(check.work / "bench")]
    args = bench.parse_args(argv)  # the flags and every runner spec are valid
    check.figures["command"] = "python bench/gpu_bench.py " + " ".join(argv)
    check.figures["configs"] = args.configs
    if check.dry:
        return
    code, log = run(
        [sys.executable, str(REPO / "bench" / "gpu_bench.py"), *argv],
        check.work / "bench.log",
        check.timeout(),
    )
    assert code == 0 and out.is_file(), f"gpu_bench exit code {code}:\n{tail(log)}"
    report = json.loads(out.read_text())
    check.figures.update({k: report.get(k) for k in ("device", "matmul_tflops", "spec_tflops", "wall_s")})
    for r in report["results"]:
        name = r["config"]
        if "tokens_per_s" in r:
            check.figures.update(
                {
                    f"{name}:tokens_per_s": r["tokens_per_s"],
                    f"{name}:mfu": r["mfu_vs_spec"],
                    f"{name}:step_s": r["step_s"],
                    f"{name}:max_mem_gib": r["max_mem_allocated_gib"],
                    f"{name}:compile_s": r.get("compile_s"),
                    f"{name}:recompiles_timed": r.get("recompiles_timed"),
                }
            )
        else:
            check.figures[f"{name}:error"] = str(r.get("error") or r.get("skipped"))[:300]
    # The FP8 twin is skipped (with its reason in the figures) only on a GPU without FP8 tensor cores.
    fp8_skipped = [
        r for r in report["results"] if r["config"].endswith(":fp8") and "FP8" in str(r.get("skipped"))
    ]
    missing = [r["config"] for r in report["results"] if "tokens_per_s" not in r and r not in fp8_skipped]
    assert not missing, {k: v for k, v in check.figures.items() if k.endswith(":error")}
    fp8 = next((r for r in report["results"] if r["config"].endswith(":fp8") and "tokens_per_s" in r), None)
    runs = {r["config"].split(":")[0]: r for r in report["results"] if not r["config"].endswith(":fp8")}
    assert runs["regional"]["recompiles_timed"] == 0, runs["regional"]
    eager, compiled = runs["eager"]["losses"], runs["regional"]["losses"]
    tolerances = [bf16_loss_tolerance(e, runs["eager"]["layers"]) for e in eager]
    check.figures["max_loss_diff_over_tolerance"] = max(
        abs(c - e) / t for e, c, t in zip(eager, compiled, tolerances, strict=True)
    )
    assert check.figures["max_loss_diff_over_tolerance"] <= 1.0, (eager, compiled, tolerances)
    if (
        fp8 is not None
    ):  # mixed_precision fp8 (regional compile): no recompile after warm-up, loss within bound
        assert fp8["recompiles_timed"] == 0, fp8
        check.figures.update(fp8_probe_figures(fp8["fp8_probes"]))
        check.figures["fp8_over_bf16_tokens_per_s"] = fp8["tokens_per_s"] / runs["regional"]["tokens_per_s"]
        assert check.figures["fp8_probe_max_ratio"] <= 1.0, fp8["fp8_probes"]


@pytest.mark.budget(75)
def test_memory_plan_1b(check: Check) -> None:
    """``bench/memory_plan_gpu.py`` on the Llama-3.2-1B shape (modes none and full): the device peak against
    the memory plan's. Fails when the script fails, a mode's model is still alive when the next starts, the
    measured peak exceeds the plan's by more than the recommender's headroom (a plan that fits would then run
    out of memory) or is under half of it (the plan would waste the GPU)."""
    script = load_script("memory_plan_gpu", REPO / "bench" / "memory_plan_gpu.py")
    out = check.work / "memory_plan.json"
    argv = ["--modes", "none,full", "--steps", "2", "--out", str(out)]
    check.figures["command"] = "python bench/memory_plan_gpu.py " + " ".join(argv)
    assert callable(script.main) and script.SHAPES["llama3.2-1b"] == (2048, 16, 32, 8, 8192, 128256)
    if check.dry:
        return
    code, log = run(
        [sys.executable, str(REPO / "bench" / "memory_plan_gpu.py"), *argv],
        check.work / "plan.log",
        check.timeout(),
    )
    assert code == 0 and out.is_file(), f"memory_plan_gpu exit code {code}:\n{tail(log)}"
    headroom = 0.1  # hf_fsdp2.plan's recommender: a plan fits at (1 - headroom) x the GPU
    for mode, entry in json.loads(out.read_text())["modes"].items():
        ratio = entry["ratio"]["peak"]
        check.figures[f"{mode}:peak_gib"] = entry["measured"]["peak"] / 2**30
        check.figures[f"{mode}:peak_vs_plan"] = ratio
        assert not entry["measured"]["previous_model_alive"], mode
        assert 0.5 <= ratio <= 1 / (1 - headroom), (mode, ratio)


@pytest.mark.budget(25)
def test_grpo_tiny(check: Check) -> None:
    """The GRPO recipe on the GPU (bf16, activation checkpointing; regional compile off: compiled layers under
    generate's growing KV cache are not checked yet): the rollout on the FSDP2 policy gathered once, the rewards,
    the loss, the verified export reloaded on the GPU. Fails when the recipe exits non-zero, its log lacks CUDA
    bf16 or the GRPO loss line, a step is missing, a step's loss, reward or gradient norm is not finite, the
    completions' mean length is not in [1, max_completion_length], or the export is not verified."""
    import random

    from support.tiny import WORDS

    model = tiny_model(check, "model", tied=False)
    prompts = check.work / "prompts.jsonl"
    rng = random.Random(3)
    prompts.write_text(
        "".join(
            json.dumps({"prompt": " ".join(rng.choices(WORDS, k=5)), "answer": rng.choice(WORDS)}) + "\n"
            for _ in range(64)
        )
    )
    values = {
        "model_name_or_path": str(model),
        "dataset_name": str(prompts),
        "max_steps": 4,
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "max_completion_length": 16,
        "max_length": 128,
        "reward_funcs": ["exact_match", "length_penalty"],
        "torch_compile": False,
        "learning_rate": 1e-4,
        "on_collapse": "warn",
    }
    # A random tiny model rarely ends a completion early and never matches: its rewards may be flat in every group,
    # a run without a learning signal that on_collapse's default stops at step 3; this check is
    # of the GPU mechanics, so it goes on (warned, and marked in metrics.jsonl and summary.json).
    run_dir, cmd = prepare_recipe(check, "grpo", values, recipe_name="grpo")
    if check.dry:
        return
    log = launch(check, cmd, run_dir, timeout=check.timeout(0.8))
    for pattern in (
        r"world size 1 on cuda\S*; mixed precision bf16",
        r"loss: GRPO dapo",
        r"export verified: ",
    ):
        assert re.search(pattern, log), f"{pattern!r} not in the log:\n{tail(log)}"
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "event" not in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4], rows
    for r in rows:
        assert all(r[k] == r[k] and abs(r[k]) < 1e6 for k in ("loss", "reward", "grad_norm")), r
        assert 1 <= r["completions/mean_length"] <= 16, r
    summary = json.loads((run_dir / "summary.json").read_text())
    check.figures.update(
        {
            "peak_memory_gib": summary.get("peak_memory_gib"),
            "wall_time_s": summary.get("wall_time_s"),
            "reward_first": rows[0]["reward"],
            "reward_last": rows[-1]["reward"],
            "step_time_s": rows[-1]["step_time_s"],
        }
    )


@pytest.mark.budget(60)
@pytest.mark.gpus(2)
def test_vllm_weight_sync(check: Check) -> None:
    """``bench/vllm_sync_bench.py``: seconds per GRPO weight update beside what it moves (docs/grpo.md, "What a weight
    sync and a rollout cost"): the trainer ranks on all GPUs but the last hold a random Llama (the Llama-3-8B shape
    on GPUs of 70 GiB or more, else the 1B shape) sharded with FSDP2, and the server's own code on the last GPU
    receives every unit over NCCL into a stand-in worker (NCCL forbids two ranks of a group on one GPU, hence two
    GPUs at least; a one-GPU node skips it before any work). Fails when the script fails, or a count differs from the
    formula: one all-gather per FSDP unit of the formula's bytes per rank, one request, one broadcast per unit of
    every parameter's bf16 bytes, no host bytes."""
    import torch

    if not check.dry and torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs (trainer and server), this node has {torch.cuda.device_count()}")
    bench = load_script("vllm_sync_bench", REPO / "bench" / "vllm_sync_bench.py")
    out = check.work / "vllm_sync.json"
    big = not check.dry and torch.cuda.get_device_properties(0).total_memory >= 70 * 2**30
    procs = 1 if check.dry else torch.cuda.device_count() - 1
    argv = ["--shape", "8b" if big else "1b", "--procs", str(procs), "--updates", "4", "--out", str(out)]
    bench.parse_args(argv)
    check.figures["command"] = "python bench/vllm_sync_bench.py " + " ".join(argv)
    if check.dry:
        return
    code, log = run(
        [sys.executable, str(REPO / "bench" / "vllm_sync_bench.py"), *argv],
        check.work / "sync.log",
        check.timeout(),
    )
    assert code == 0 and out.is_file(), f"vllm_sync_bench exit code {code}:\n{tail(log)}"
    report = json.loads(out.read_text())
    counts, formula = report["counts"], report["formula"]
    check.figures.update({k: report.get(k) for k in ("shape", "ranks", "update_s", "gather_s")})
    check.figures.update({f"counts:{k}": v for k, v in counts.items()})
    check.figures["per_parameter_fp32:all_gathers"] = report["per_parameter_fp32"]["all_gathers"]
    for key in ("all_gathers", "gathered_bytes", "broadcasts", "broadcast_bytes", "requests", "host_bytes"):
        assert counts[key] == formula[key], (key, counts, formula)


@pytest.mark.budget(30)
def test_liger(check: Check) -> None:
    """tests/unit/test_liger_gpu.py with ``HF_FSDP2_GPU_CHECK=1``: Liger's kernels give the plain loss and
    gradients. Fails (never skips) when liger-kernel (the offline bundle's) or CUDA is missing, or the kernels
    differ from the plain path. With it, the chunked loss's feature test: on CUDA the head gradient must take
    the fp32-accumulating GEMM (``addmm`` with ``out_dtype``), else it fails."""
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--rootdir",
        str(REPO),
        "-c",
        str(REPO / "pyproject.toml"),
        str(REPO / "tests" / "unit" / "test_liger_gpu.py"),
        str(REPO / "tests" / "unit" / "test_loss.py") + "::test_fp32_accumulating_addmm_is_feature_tested",
    ]
    check.figures["command"] = (
        "HF_FSDP2_GPU_CHECK=1 python -m pytest tests/unit/test_liger_gpu.py "
        "tests/unit/test_loss.py::test_fp32_accumulating_addmm_is_feature_tested"
    )
    assert (REPO / "tests" / "unit" / "test_liger_gpu.py").is_file()
    if check.dry:
        return
    code, log = run(cmd, check.work / "liger.log", check.timeout(), extra_env={"HF_FSDP2_GPU_CHECK": "1"})
    check.figures["liger_kernel"] = importlib.util.find_spec("liger_kernel") is not None
    assert code == 0 and "2 passed" in log, tail(log)


def load_script(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
