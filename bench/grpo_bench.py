"""GRPO on GPUs: generation tokens/s and training tokens/s of the recipe, with transformers' ``generate`` on the
sharded policy, with the vLLM server, and with vLLM colocated in the training processes.

    python bench/grpo_bench.py --out bench/out/grpo_1b.json                  # 2 GPUs: 1B shape, transformers and the server
    python bench/grpo_bench.py --model /path/to/Llama-3.2-1B --procs 7        # a real model folder, 7 trainer GPUs + the server
    python bench/grpo_bench.py --dry-run                                      # any machine: the plan and commands
    python bench/grpo_bench.py --smoke --out /tmp/grpo_bench.json             # any machine: CPU, tiny, transformers
    python bench/grpo_bench.py --backends colocate --steps 4 --warmup 1       # one GPU: vLLM in the training process

The work: ``recipes/grpo.py`` itself, launched by ``torchrun`` once per backend on the same model, prompts and keys
(``--procs`` ranks, bf16, ``--steps`` steps of ``--prompts`` prompts x ``--generations`` completions of
``--completion`` tokens, reward ``length_penalty``). The model: ``--model`` (an HF folder), else a random-init
Llama-3.2-1B shape (hidden 2048, 16 layers, 32 / 8 KV heads, MLP 8192, tied) built in ``--work`` with the 32k
Llama-2 test tokenizer of tests/support/tiny.py (no hub on the GPU node): vocabulary 32k instead of 128k, so its
head is a quarter of the real one's. A random model never samples its end token: every completion is
``--completion`` tokens long, the same work on both sides.

What is measured, from each run's metrics.jsonl (the first ``--warmup`` steps left out):
- generation tokens/s = completion tokens sampled on every rank / seconds inside the generator's ``generate`` calls
  (``rollout/*`` of hf_fsdp2/methods/grpo/timing.py: the slowest rank's clock, the vLLM weight sync left out and
  reported on its own as ``weight_sync_s`` per step);
- training tokens/s = the rows' tokens the step trained on (prompt + completion, every rank; the meter's
  ``tokens``) / the step's seconds outside the rollout (scoring the sampler's log-probs where vLLM's need
  correcting, rewards, forward, backward, optimizer update);
- seconds per step, and the run's peak memory (summary.json).

vLLM needs its own environment (``.venv-vllm``; ``bash scripts/setup_vllm.sh`` builds it, ``HF_FSDP2_VLLM_SPEC=vllm``
on a GPU node) or ``--vllm-python``. Without it the vLLM side is reported as not run, with that reason and the fix,
and the transformers side still runs. With it, the server (``hf-fsdp2 vllm-serve``) runs on the GPU after the
trainers' (``CUDA_VISIBLE_DEVICES``: the weights go over an NCCL group of trainer rank 0 and the engine, and NCCL
forbids two ranks of a group on one GPU; a node without a spare GPU reports the server backend as not run, with that
reason), started before and stopped after its run; ``colocate`` runs the recipe itself with that Python
(``vllm_mode: colocate``: an engine in each training process, ``--vllm-gpu-memory-utilization`` of its GPU).
Per step beside the seconds, for the vLLM backends: engine calls, prompts prefilled, the weight load's all-gathers,
bytes gathered per rank, bytes broadcast to the server and host bytes (hf_fsdp2/methods/grpo/timing.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BACKENDS = {"hf": "transformers generate", "vllm": "vLLM server", "colocate": "vLLM colocate"}
COLOCATE = [
    "--use_vllm",
    "true",
    "--vllm_mode",
    "colocate",
]  # with --vllm_gpu_memory_utilization (recipe_args)
VLLM_COUNTS = (  # hf_fsdp2/methods/grpo/timing.py's (this script imports nothing of hf_fsdp2)
    "rollout/engine_calls",
    "rollout/engine_prompts",
    "rollout/sync_all_gathers",
    "rollout/sync_gathered_bytes",
    "rollout/sync_broadcast_bytes",
    "rollout/sync_host_bytes",
)
LLAMA_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "tie_word_embeddings": True,
    "rope_theta": 500000.0,
}
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "tie_word_embeddings": True,
}
SMOKE = {
    "shape": "tiny",
    "procs": 1,
    "steps": 2,
    "warmup": 0,
    "prompts": 2,
    "generations": 2,
    "completion": 4,
    "prompt_tokens": 8,
    "backends": "hf",
    "cpu": True,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="an HF model folder (default: a random Llama-3.2-1B shape)")
    ap.add_argument("--shape", choices=("1b", "tiny"), default="1b", help="the random model's shape")
    ap.add_argument(
        "--backends",
        default="hf,vllm",
        help="hf (transformers generate), vllm (the server), colocate (vLLM in the training processes), comma-separated",
    )
    ap.add_argument("--procs", type=int, default=1, help="training ranks (GPUs)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of the figures")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step (every rank's together)")
    ap.add_argument("--generations", type=int, default=8, help="completions per prompt (num_generations)")
    ap.add_argument("--completion", type=int, default=512, help="max_completion_length")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="tokens per prompt (about)")
    ap.add_argument(
        "--vllm-python", default=None, help="the Python with vLLM (default: .venv-vllm/bin/python)"
    )
    ap.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument(
        "--work", default=None, help="folder for the model, prompts and runs (default: a temp folder)"
    )
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="one backend's run is stopped after")
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU, fp32 (what --smoke uses)")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny model, 1 CPU process, 2 steps, transformers only"
    )
    ap.add_argument("--dry-run", action="store_true", help="print the plan and commands; run nothing")
    ap.add_argument("--out", default=None, help="write the JSON report here")
    args = ap.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = [b for b in args.backends if b not in BACKENDS]
    if bad or not args.backends:
        ap.error(f"--backends {','.join(args.backends)}: give some of {', '.join(BACKENDS)}, comma-separated")
    if args.prompts * args.generations % args.procs:
        ap.error(
            f"--prompts {args.prompts} x --generations {args.generations} must split evenly over --procs "
            f"{args.procs} (whole completions per rank)"
        )
    if args.steps <= args.warmup:
        ap.error(f"--steps {args.steps} must exceed --warmup {args.warmup}: nothing would be measured")
    return args


def vllm_python(explicit: str | None) -> tuple[str | None, str]:
    """The Python that runs the server, or None and why (the message the report carries)."""
    chosen = Path(explicit) if explicit else REPO / ".venv-vllm" / "bin" / "python"
    if chosen.exists():
        return str(chosen), ""
    return None, (
        f"vLLM is not installed here: {chosen} does not exist. The GPU image has no vLLM; build its "
        "environment with `HF_FSDP2_VLLM_SPEC=vllm bash scripts/setup_vllm.sh` (or give --vllm-python), "
        "then run the vLLM side again: python bench/grpo_bench.py --backends vllm"
    )


def recipe_args(args: argparse.Namespace, model: str, data: str, out: str) -> list[str]:
    """The recipe's command line (TRL's batch meaning: per_device_train_batch_size counts completions)."""
    per_rank = args.prompts * args.generations // args.procs
    micro = next(
        m for m in range(min(per_rank, 16), 0, -1) if per_rank % m == 0
    )  # <= 16 completions per backward
    return [
        "--model_name_or_path",
        model,
        "--dataset_name",
        data,
        "--output_dir",
        out,
        "--max_steps",
        str(args.steps),
        "--per_device_train_batch_size",
        str(micro),
        "--gradient_accumulation_steps",
        str(per_rank // micro),
        "--gradient_checkpointing",
        "false" if args.cpu else "true",
        "--num_generations",
        str(args.generations),
        "--max_completion_length",
        str(args.completion),
        "--max_length",
        str(args.completion + args.prompt_tokens + 16),
        "--reward_funcs",
        "length_penalty",
        # A random model never ends early: every completion's reward is the same, a run without a learning signal that
        # on_collapse's default stops at step 3; the bench measures the mechanics, so it goes on (warned).
        "--on_collapse",
        "warn",
        "--temperature",
        "1.0",
        "--learning_rate",
        "1e-6",
        "--lr_scheduler_type",
        "constant",
        "--logging_steps",
        "1",
        "--save_steps",
        "0",
        "--seed",
        "0",
        "--export_verify",
        "false",
        "--mixed_precision",
        "no" if args.cpu else "bf16",
        "--torch_dtype",
        "float32",
        "--overwrite_output_dir",
        "true",
    ]


def launch(args: argparse.Namespace, extra: list[str], python: str = sys.executable) -> list[str]:
    """torchrun of the recipe with ``python`` (colocate: the vLLM environment's, which imports the trainer too)."""
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(args.procs),
        str(REPO / "recipes" / "grpo.py"),
        *extra,
    ]


def build_assets(args: argparse.Namespace, work: Path) -> tuple[str, str]:
    """The model folder and the prompts (JSONL, ``prompt`` column)."""
    import random

    sys.path.insert(0, str(REPO / "tests"))
    from support.tiny import WORDS, build_llama2_test_tokenizer, save_tokenizer

    data = work / "prompts.jsonl"
    rng = random.Random(0)
    with data.open("w") as fh:
        for _ in range(args.prompts * args.steps):
            fh.write(
                json.dumps({"prompt": " ".join(rng.choices(WORDS, k=max(args.prompt_tokens // 2, 1)))}) + "\n"
            )
    if args.model:
        return args.model, str(data)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = work / f"llama_{args.shape}"
    if not (folder / "config.json").exists():
        tok = build_llama2_test_tokenizer()
        tok.pad_token = tok.eos_token
        shape = LLAMA_1B if args.shape == "1b" else TINY
        config = LlamaConfig(
            vocab_size=len(tok),
            max_position_embeddings=4096,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            **shape,
        )
        torch.manual_seed(0)
        LlamaForCausalLM(config).to(torch.float32 if args.cpu else torch.bfloat16).save_pretrained(folder)
        save_tokenizer(tok, folder)
    return str(folder), str(data)


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(
    args: argparse.Namespace, python: str, model: str, log: Path
) -> tuple[subprocess.Popen[bytes], str]:
    """``hf-fsdp2 vllm-serve`` in its own session (stopping it stops vLLM's engine process too); waits until ready."""
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "hf_fsdp2.cli",
        "vllm-serve",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32" if args.cpu else "bfloat16",
        "--python",
        python,
        "--max-model-len",
        str(args.completion + args.prompt_tokens + 16),
        "--gpu-memory-utilization",
        str(args.vllm_gpu_memory_utilization),
    ]
    env = dict(os.environ)
    if not args.cpu:  # the GPU after the trainers' (NCCL: one rank of the weight group per GPU)
        env["CUDA_VISIBLE_DEVICES"] = str(args.procs)
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    start = time.monotonic()
    while "ready on http" not in log.read_text():
        if proc.poll() is not None or time.monotonic() - start > 900:
            stop_server(proc)
            raise RuntimeError(
                f"the vLLM server did not start (exit {proc.returncode}): {log.read_text()[-2000:]}"
            )
        time.sleep(2)
    return proc, f"http://127.0.0.1:{port}"


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's session (its engine process too), SIGKILL after 30 s."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def figures(run: Path, warmup: int) -> dict[str, Any]:
    """Generation and training tokens/s, seconds per step, from the run's metrics.jsonl (module docstring)."""
    rows = [
        r
        for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if "rollout/generate_s" in r
    ]
    timed = [r for r in rows if r["step"] > warmup]
    if not timed:
        raise RuntimeError(f"{run}/metrics.jsonl has no step after --warmup {warmup} with rollout/* metrics")
    gen = sum(r["rollout/generate_s"] for r in timed)
    sync = sum(r["rollout/weight_sync_s"] for r in timed)
    step = sum(r["step_time_s"] for r in timed)  # logging_steps 1: one step per row
    summary = json.loads((run / "summary.json").read_text())
    return {
        "steps_timed": len(timed),
        "step_s": step / len(timed),
        "generation_tokens_per_s": sum(r["rollout/completion_tokens"] for r in timed) / gen,
        "generate_s_per_step": gen / len(timed),
        "weight_sync_s_per_step": sync / len(timed),
        "training_tokens_per_s": sum(r["tokens"] for r in timed) / max(step - gen - sync, 1e-9),
        "completion_tokens_per_step": sum(r["rollout/completion_tokens"] for r in timed) / len(timed),
        "peak_memory_gib": summary.get("peak_memory_gib"),
        "peak_memory_kind": summary.get("peak_memory_kind"),
        # vLLM's counts beside its seconds (hf_fsdp2/methods/grpo/timing.py VLLM_COUNTS; docs/grpo.md "What a weight
        # sync and a rollout cost"), per step
        **{
            key.replace("rollout/", "") + "_per_step": sum(r[key] for r in timed) / len(timed)
            for key in VLLM_COUNTS
            if all(key in r for r in timed)
        },
    }


def run_backend(
    args: argparse.Namespace,
    backend: str,
    model: str,
    data: str,
    work: Path,
    run: Callable[..., Any] = subprocess.run,
) -> dict[str, Any]:
    """One backend's recipe run, its torchrun started by ``run`` (subprocess.run; the tests fork the same command)."""
    out = work / f"run_{backend}"
    extra = recipe_args(args, model, data, str(out))
    row: dict[str, Any] = {"backend": BACKENDS[backend]}
    server, python, vllm = None, sys.executable, ""
    if backend != "hf":
        found, why = vllm_python(args.vllm_python)
        if found is None:
            return {**row, "not_run": why}
        vllm = found
    if backend == "colocate":
        python = vllm
        extra += [*COLOCATE, "--vllm_gpu_memory_utilization", str(args.vllm_gpu_memory_utilization)]
    if backend == "vllm":
        spare = None if args.cpu or args.dry_run else _gpus() - args.procs
        if spare is not None and spare < 1:
            return {
                **row,
                "not_run": (
                    f"the server needs a GPU of its own: {args.procs} trainer rank(s) on a node of "
                    f"{args.procs + spare} GPU(s), and NCCL forbids two ranks of the weight group on one GPU; "
                    f"give --procs {args.procs + spare - 1} or --backends colocate"
                ),
            }
        if args.dry_run:
            row["server"] = f"hf-fsdp2 vllm-serve --model {model} --python {vllm} ..."
        else:
            server, url = start_server(args, vllm, model, work / "vllm_server.log")
            extra += ["--use_vllm", "true", "--vllm_server_base_url", url]
    cmd = launch(args, extra, python)
    row["command"] = shlex.join(cmd)
    if args.dry_run:
        return row
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if backend == "colocate":  # the vLLM environment runs the trainer from this checkout
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    if args.cpu:
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    try:
        with (work / f"run_{backend}.log").open("w") as log:
            done = run(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=args.timeout_s,
                cwd=REPO,
                check=False,
            )
    finally:
        if server is not None:
            stop_server(server)
    if done.returncode != 0:
        tail = (work / f"run_{backend}.log").read_text()[-3000:]
        return {**row, "error": f"exit {done.returncode}", "log_tail": tail}
    return {**row, **figures(out, args.warmup)}


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| backend | s/step | generation tok/s | weights to vLLM s/step | training tok/s | peak GiB | vLLM per step: "
        "engine calls, prompts, all-gathers, GB gathered per rank, GB broadcast, host bytes |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "step_s" in r:
            counts = (
                f"{r['engine_calls_per_step']:.1f}, {r['engine_prompts_per_step']:.1f}, "
                f"{r['sync_all_gathers_per_step']:.1f}, {r['sync_gathered_bytes_per_step'] / 1e9:.2f}, "
                f"{r['sync_broadcast_bytes_per_step'] / 1e9:.2f}, {r['sync_host_bytes_per_step']:.0f}"
                if "engine_calls_per_step" in r
                else "-"
            )
            lines.append(
                f"| {r['backend']} | {r['step_s']:.2f} | {r['generation_tokens_per_s']:.0f} | "
                f"{r['weight_sync_s_per_step']:.2f} | {r['training_tokens_per_s']:.0f} | "
                f"{r['peak_memory_gib'] or 0:.1f} | {counts} |"
            )
        else:
            lines.append(
                f"| {r['backend']} | {r.get('not_run') or r.get('error') or 'planned: ' + r['command']} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None, run: Callable[..., Any] = subprocess.run) -> int:
    """The command line (``argv``, default sys.argv); ``run`` starts each backend's torchrun (:func:`run_backend`)."""
    import tempfile

    args = parse_args(argv)
    work = Path(args.work or ("<work>" if args.dry_run else tempfile.mkdtemp(prefix="grpo_bench_")))
    if not args.dry_run:
        work.mkdir(parents=True, exist_ok=True)
    model, data = (args.model or f"(random {args.shape} Llama, built in {work})", str(work / "prompts.jsonl"))
    if not args.dry_run:
        model, data = build_assets(args, work)
    plan = {
        "model": model,
        "procs": args.procs,
        "steps": args.steps,
        "warmup": args.warmup,
        "prompts_per_step": args.prompts,
        "generations": args.generations,
        "completion_tokens": args.completion,
        "prompt_tokens": args.prompt_tokens,
        "device": "cpu (gloo, fp32)" if args.cpu else "cuda (bf16)",
    }
    rows = [run_backend(args, backend, model, data, work, run) for backend in args.backends]
    report = {"plan": plan, "results": rows}
    print(json.dumps(plan))
    print(table(rows))
    for r in rows:
        if "not_run" in r:
            print(f"NOTE {r['backend']}: {r['not_run']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
