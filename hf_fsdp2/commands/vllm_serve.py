"""``hf-fsdp2 vllm-serve``: the vLLM rollout server of the GRPO recipe (``use_vllm: true``, ``vllm_mode: server``),
like TRL's ``trl vllm-serve``.

vLLM pins its own torch and an older transformers than the trainer's, so it lives in its own virtual environment
(``.venv-vllm``, built by ``scripts/setup_vllm.sh``, which ``scripts/setup.sh`` runs). This command runs the server file
(:mod:`hf_fsdp2.methods.grpo.vllm.server`) with that environment's Python: ``--python``, else ``HF_FSDP2_VLLM_PYTHON``,
else ``.venv-vllm/bin/python`` beside this checkout, else this Python when it has vLLM.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

from hf_fsdp2.commands.common import BadInput, Subparsers

SERVER = Path(__file__).resolve().parents[1] / "methods" / "grpo" / "vllm" / "server.py"
CHECKOUT_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"


def has_vllm() -> bool:
    """Whether this Python can import vLLM (not imported here: it takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def vllm_python(explicit: str | None = None) -> str:
    """The Python that runs the server (module docstring's order).

    Raises:
        BadInput: none of them has vLLM.
    """
    if explicit or os.environ.get("HF_FSDP2_VLLM_PYTHON"):
        chosen = Path(explicit or os.environ["HF_FSDP2_VLLM_PYTHON"])
        if not chosen.exists():
            raise BadInput(
                f"--python / HF_FSDP2_VLLM_PYTHON={chosen} does not exist: give the python of an "
                "environment with vLLM (bash scripts/setup_vllm.sh builds .venv-vllm)"
            )
        return str(chosen)
    if CHECKOUT_VENV.exists():
        return str(CHECKOUT_VENV)
    if has_vllm():
        return sys.executable
    raise BadInput(
        f"no Python with vLLM: {CHECKOUT_VENV} does not exist and this Python ({sys.executable}) has no "
        "vllm; build it with `bash scripts/setup_vllm.sh` (its own environment: vLLM pins another "
        "torch and transformers), or pass --python"
    )


def server_command(args: argparse.Namespace, python: str) -> list[str]:
    """The server's command line (``-P``: the server file's folder is not put on sys.path, so the grpo package's
    module names shadow nothing)."""
    cmd = [
        python,
        "-P",
        str(SERVER),
        "--model",
        str(args.model),
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--dtype",
        args.dtype,
        "--gpu-memory-utilization",
        str(args.gpu_memory_utilization),
        "--tensor-parallel-size",
        str(args.tensor_parallel_size),
        "--kv-cache-gib",
        str(args.kv_cache_gib),
        "--seed",
        str(args.seed),
    ]
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    return cmd


def _run_vllm_serve(args: argparse.Namespace) -> int:
    if not Path(args.model).is_dir():
        raise BadInput(
            f"--model {args.model} is not a folder: give the HF model folder the run starts from "
            "(model_name_or_path; convert a hub model with save_pretrained first)"
        )
    python = vllm_python(args.python)
    cmd = server_command(args, python)
    print(" ".join(cmd), file=sys.stderr, flush=True)
    os.execv(python, cmd)  # the server is this process from here on: a signal to it reaches vLLM
    return 0  # not reached


def register_vllm_serve(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "vllm-serve",
        help="the vLLM rollout server for GRPO (use_vllm: true, vllm_mode: server)",
        description=(
            "Serve MODEL with vLLM for the GRPO recipe's rollouts: the trainer sends prompts and, after each "
            "optimizer update, its weights (one layer at a time). Runs in the vLLM environment (.venv-vllm; "
            "scripts/setup_vllm.sh builds it). Then train with use_vllm: true, vllm_server_port: PORT."
        ),
    )
    p.add_argument("--model", type=Path, required=True, help="the HF model folder the run starts from")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default: 0.0.0.0)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000, TRL's vllm_server_port)")
    p.add_argument(
        "--dtype", default="auto", help="vLLM's dtype: auto (the model's), bfloat16, float32, float16"
    )
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + completion tokens at most")
    p.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="GPU memory fraction (default 0.9)"
    )
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs the server shards over")
    p.add_argument("--kv-cache-gib", type=int, default=1, help="CPU only: KV cache size in GiB (default 1)")
    p.add_argument("--seed", type=int, default=0, help="engine seed (every request carries its own)")
    p.add_argument("--python", default=None, help="the Python with vLLM (default: .venv-vllm/bin/python)")
    p.set_defaults(func=_run_vllm_serve)
