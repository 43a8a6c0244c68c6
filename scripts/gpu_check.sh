#!/usr/bin/env bash
# The GPU check, on a machine with a CUDA GPU (one H200: at most 9 minutes of checks). Runs the checks of
# tests/gpu/ (tests/gpu/test_gpu_checks.py says what each asserts and what makes it fail): the SFT recipe at
# world size 1 (bf16, regional compile, activation checkpointing, chunked CE) on a tied/untied tiny Llama built
# in code, each export verified and reloaded on the GPU; LoRA + merge; QLoRA (4-bit NF4 base) + merge; activation
# offload vs none; a CUDA memory snapshot; `bench/gpu_bench.py --quick` (1B shape); the 1B memory plan vs the
# measured peak; the GRPO recipe (rollout on the FSDP2 policy, rewards, verified export); the Liger test; expert
# parallel vs flat FSDP2 (bench/moe_bench.py ep on 2 gloo ranks: bytes per collective beside seconds); with
# .venv-vllm, GRPO with vLLM colocated (engine calls, prompts prefilled, the weight load's all-gathers and bytes
# beside seconds: bench/grpo_bench.py); with 2+ GPUs, ring context parallel (cp 2 ring vs all-to-all vs cp 1 at
# 8k tokens), the GRPO weight sync to a vLLM server (bench/vllm_sync_bench.py), the vLLM server's rollouts, and
# context parallel + Muon at 8k tokens (bench/gpu_bench_parallel.py); with 4+, tensor parallel 2 x FSDP2 2 (the
# step's all-gathers and reduce-scatters beside seconds); each count held to its formula (tests/support/count_formulas.py),
# skipped with the reason where the node lacks the GPUs (NCCL forbids two ranks on one device) or vLLM. Nothing is
# downloaded. A failing check does not stop the others; each has a budget, printed beside its time.
#
#   bash scripts/gpu_check.sh                  # scripts/setup.sh first (CUDA torch where nvidia-smi lists a GPU)
#   bash scripts/gpu_check.sh --no-setup       # .venv as it is
#   bash scripts/gpu_check.sh --offline        # air-gapped node: its python3 ($PYTHON), no setup, no index;
#                                              # offline_bundle/ (or --bundle DIR) installed into a folder first
#   bash scripts/gpu_check.sh --dry-run        # any machine: list the checks, validate every command, run nothing
#   bash scripts/gpu_check.sh --out PATH       # the summary's path (default outputs/gpu_check/summary-<time>.json)
#   bash scripts/gpu_check.sh -k sft_tiny      # only the checks whose name matches (pytest -k)
#
# Offline is also chosen when HF_FSDP2_OFFLINE=1, or when there is no .venv and the package index does not
# answer within 3 s (PIP_NO_INDEX set: not asked at all). Each check's files stay in <summary>.work/.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
DRY="" SETUP=1 OUT="" SELECT="" OFFLINE=${HF_FSDP2_OFFLINE:-} BUNDLE=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=--gpu-dry-run ;;
    --no-setup) SETUP=0 ;;
    --offline) OFFLINE=1 ;;
    --bundle) BUNDLE=${2:?--bundle needs a folder (what scripts/offline_bundle.sh built)}; OFFLINE=1; shift ;;
    --out) OUT=${2:?--out needs a path}; shift ;;
    -k) SELECT=${2:?-k needs an expression}; shift ;;
    -h | --help) sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (--dry-run, --no-setup, --offline, --bundle DIR, --out PATH, -k EXPR)" >&2
       exit 2 ;;
  esac
  shift
done
OUT=${OUT:-outputs/gpu_check/summary-$(date +%Y%m%d-%H%M%S).json}
case "$OUT" in /*) ;; *) OUT=$REPO/$OUT ;; esac
[ -n "$DRY" ] && SETUP=0  # a dry run installs nothing (it passes with PIP_NO_INDEX=1)
RUN_IN=$REPO
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# Is the package index there? Asked only when it matters (no .venv, offline not chosen), for 3 s at most.
index_reachable() {
  case "${PIP_NO_INDEX:-}" in 1 | true | yes | on) return 1 ;; esac
  local url=${PIP_INDEX_URL:-https://pypi.org/simple} host port
  host=${url#*://}; host=${host%%/*}; host=${host##*@}; port=443
  case "$url" in http://*) port=80 ;; esac
  case "$host" in *:*) port=${host##*:}; host=${host%%:*} ;; esac
  timeout 3 bash -c "exec 3<>/dev/tcp/$host/$port" 2>/dev/null
}
if [ -z "$OFFLINE" ] && [ "$SETUP" = 1 ] && [ ! -x .venv/bin/python ] && ! index_reachable; then
  echo "gpu_check.sh: no .venv and no package index reachable: offline mode (the node's python3)" >&2
  OFFLINE=1
fi
[ "$OFFLINE" = 0 ] && OFFLINE=""

if [ -n "$OFFLINE" ]; then
  # The node's own Python and packages; nothing from an index, ever (pip is told there is none).
  PY=${PYTHON:-python3}
  command -v "$PY" >/dev/null || { echo "gpu_check.sh: no Python at $PY (set PYTHON=/path/to/python3)" >&2; exit 1; }
  export PIP_NO_INDEX=1 PIP_INDEX_URL=http://127.0.0.1:9/no-index PIP_DISABLE_PIP_VERSION_CHECK=1
  STAGE=${OUT%.json}.site
  rm -rf "$STAGE"; mkdir -p "$STAGE/checkout/hf_fsdp2"
  # The checkout as the installed package lays it out (accelerate_configs/ and recipes/configs/ inside hf_fsdp2),
  # by links: the launch line's `-m hf_fsdp2.methods sft` then runs from this checkout, nothing installed.
  for entry in "$REPO"/hf_fsdp2/*; do ln -s "$entry" "$STAGE/checkout/hf_fsdp2/"; done
  ln -s "$REPO/accelerate_configs" "$STAGE/checkout/hf_fsdp2/accelerate_configs"
  ln -s "$REPO/recipes/configs" "$STAGE/checkout/hf_fsdp2/recipe_configs"
  SITE=""
  if [ -z "$BUNDLE" ] && [ -d offline_bundle ]; then BUNDLE=offline_bundle; fi
  if [ -n "$BUNDLE" ]; then
    [ -f "$BUNDLE/requirements.txt" ] || { echo "gpu_check.sh: $BUNDLE/requirements.txt is missing (build it with scripts/offline_bundle.sh)" >&2; exit 1; }
    SITE=$STAGE/bundle
    LINKS=(--find-links "$BUNDLE"); [ -d "$BUNDLE/wheels" ] && LINKS+=(--find-links "$BUNDLE/wheels")
    echo "gpu_check.sh: $PY -m pip install --no-index --no-deps --target $SITE ${LINKS[*]} -r $BUNDLE/requirements.txt"
    "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "${LINKS[@]}" -r "$BUNDLE/requirements.txt" \
      || { echo "gpu_check.sh: installing the offline bundle $BUNDLE failed (nothing was fetched from an index)" >&2; exit 1; }
  fi
  export PYTHONPATH="$STAGE/checkout:$REPO${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
  # `python -m` puts its working folder first on sys.path: the checks and their processes run in the laid-out
  # checkout, or the bare checkout's hf_fsdp2 (no recipes inside) would shadow it.
  RUN_IN=$STAGE/checkout
  export HF_FSDP2_CHECKOUT=$RUN_IN
  echo "gpu_check.sh: offline: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])')), PYTHONPATH=$PYTHONPATH"
else
  PY=.venv/bin/python
  if [ "$SETUP" = 1 ]; then
    bash scripts/setup.sh || { echo "gpu_check.sh: scripts/setup.sh failed" >&2; exit 1; }
  fi
fi
export HF_FSDP2_GPU_CHECK=1
if [ -z "$DRY" ] && ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  "$PY" -c "import torch; print(f'gpu_check.sh: torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees no CUDA device')" >&2
  echo "gpu_check.sh: nothing to check here; --dry-run validates the checks on any machine" >&2
  exit 1
fi
mkdir -p "$(dirname "$OUT")"
# --basetemp: pytest empties this folder first; it is named after the summary, so it is this run's own.
(cd "$RUN_IN" && "$PY" -m pytest "$REPO/tests/gpu" -m gpu -v -p no:cacheprovider --rootdir "$REPO" \
  -c "$REPO/pyproject.toml" --basetemp "${OUT%.json}.work" --gpu-report "$OUT" $DRY ${SELECT:+-k "$SELECT"})
status=$?
echo "GPU check summary: $OUT"
exit $status
