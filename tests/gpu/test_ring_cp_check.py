"""The ring context-parallel check of `bash scripts/gpu_check.sh` (needs 2 CUDA GPUs: NCCL refuses two ranks on one
device, so on a one-GPU node it is skipped with that reason; ``--gpu-dry-run`` validates its commands anywhere).

Continued pre-training rows of 8,192 tokens (one long document cut into rows: a plain causal mask, what ring
attention runs) on a small random-init Llama (8 heads, 2 KV heads), 4 steps of 2 micro-batches, the GPU path of the
other checks (bf16, regional compile, activation checkpointing, the chunked loss), three ways through the real
launch line: one process (cp 1), 2 processes with ``cp_backend: all_to_all`` and 2 with ``cp_backend: ring``. The
cp runs have one data rank, so all three train on the same batches and their per-step losses must agree within the
derived bf16 bound (tests/gpu/tolerances.py). It fails when ring attention is not what the run used (the start-up
line), when a run fails (a kernel or compile problem under ``context_parallel``), or when a loss leaves the bound (a
wrong layout, label shift or mask).
"""

from __future__ import annotations

import random
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from hf_fsdp2.launch import launch_command
from hf_fsdp2.methods import parse_method_config
from hf_fsdp2.observe.logs import read_metrics

from .assets import WORDS, build_tokenizer, llama_config
from .conftest import Check
from .test_gpu_checks import GPU_KEYS, free_port, run, tail
from .tolerances import bf16_loss_tolerance

pytestmark = pytest.mark.gpu

SEQ = 8192
SMALL = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
}
RUN = {
    "max_steps": 4,
    "per_device_train_batch_size": 1,
    "gradient_accumulation_steps": 2,
    "learning_rate": 1e-4,
    "max_length": SEQ,
    "ce_chunk_tokens": 2048,
    "text_unit": "document",
    "corpus_layout": "concat",
    "cross_document_attention": True,
    "export_verify": False,
    "attn_implementation": "sdpa",
}
# name: (processes, extra keys)
WAYS: dict[str, tuple[int, dict[str, Any]]] = {
    "cp1": (1, {}),
    "all_to_all": (2, {"cp_size": 2, "cp_backend": "all_to_all"}),
    "ring": (2, {"cp_size": 2, "cp_backend": "ring"}),
}
NEEDS_TWO = "needs >= 2 CUDA GPUs: NCCL forbids two ranks on one device (this node has {n})"


def _assets(work: Path) -> tuple[Path, Path]:
    from transformers import LlamaForCausalLM

    tokenizer = build_tokenizer()
    config = llama_config("tiny", tied=False, vocab_size=len(tokenizer), max_positions=SEQ)
    for key, value in SMALL.items():
        setattr(config, key, value)
    config.head_dim = SMALL["hidden_size"] // SMALL["num_attention_heads"]
    torch.manual_seed(3)
    model_dir = work / "model"
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    corpus = work / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)  # one document of ~9 rows' tokens: 8 rows trained, every row one causal sequence
    (corpus / "book.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(9 * SEQ)) + "\n")
    return model_dir, corpus


def _prepare(check: Check, name: str, procs: int, values: dict[str, Any]) -> tuple[Path, list[str]]:
    from accelerate.commands.launch import launch_command_parser

    folder = check.work / name
    folder.mkdir(parents=True, exist_ok=True)
    recipe = folder / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({**GPU_KEYS, **values, "output_dir": str(folder / "run")}))
    parse_method_config(
        "cpt", ["--config", str(recipe)]
    )  # unknown keys and bad values fail here, dry run too
    cmd = launch_command(
        "cpt", ["--config", str(recipe)], num_processes=procs, gpus=procs, main_process_port=free_port()
    )
    launch_command_parser().parse_args(cmd[3:])
    check.figures[f"{name}:command"] = " ".join(["accelerate launch", *cmd[3:]])
    return folder / "run", cmd


@pytest.mark.budget(150)
@pytest.mark.gpus(2)
def test_ring_cp(check: Check) -> None:
    """Ring cp 2 vs all-to-all cp 2 vs cp 1: per-step losses at 8k tokens within the derived bf16 bound."""
    if not check.dry and torch.cuda.device_count() < 2:  # before any work: a one-GPU node spends nothing here
        pytest.skip(NEEDS_TWO.format(n=torch.cuda.device_count()))
    model_dir, corpus = _assets(check.work)
    base = {**RUN, "model_name_or_path": str(model_dir), "dataset_name": str(corpus)}
    runs = {
        name: (procs, *_prepare(check, name, procs, {**base, **extra}))
        for name, (procs, extra) in WAYS.items()
    }
    check.figures["command"] = check.figures["ring:command"]
    if check.dry:
        return
    losses: dict[str, list[float]] = {}
    for name, (_procs, run_dir, cmd) in runs.items():
        start = time.perf_counter()
        code, log = run(cmd, run_dir.parent / "launch.log", check.timeout(1 / 3))
        check.figures[f"{name}:launch_s"] = round(time.perf_counter() - start, 1)
        assert code == 0, f"{name}: exit code {code}; log {run_dir.parent / 'launch.log'}:\n{tail(log)}"
        if name == "ring":
            assert re.search(r"ring attention \(torch context_parallel, SDPA\) over 2 ranks", log), tail(log)
        rows = read_metrics(run_dir / "metrics.jsonl")
        losses[name] = [float(r["loss"]) for r in rows]
        check.figures[f"{name}:losses"] = losses[name]
        check.figures[f"{name}:tokens_per_s"] = rows[-1].get("tokens_per_s")
    layers = SMALL["num_hidden_layers"]
    for name in ("all_to_all", "ring"):
        assert len(losses[name]) == len(losses["cp1"]) == RUN["max_steps"], losses
        check.figures[f"{name}:max_loss_diff_over_tolerance"] = max(
            abs(got - want) / bf16_loss_tolerance(want, layers)
            for want, got in zip(losses["cp1"], losses[name], strict=True)
        )
    assert max(check.figures[f"{n}:max_loss_diff_over_tolerance"] for n in ("all_to_all", "ring")) <= 1.0, (
        losses
    )
