#!/usr/bin/env bash
# The GPU check, on a machine with a CUDA GPU (sized for one H200: ~8 min after set-up). Runs the checks of
# tests/gpu/ (tests/gpu/test_gpu_checks.py says what each does): the SFT recipe at world size 1 with bf16 +
# regional compile + activation checkpointing + chunked cross entropy on SmolLM2-135M and on a tied/untied
# tiny Llama pair, each export verified and reloaded on the GPU; LoRA + merge; activation offload; a CUDA
# memory snapshot; `bench/gpu_bench.py --quick`. A failing check does not stop the others; each has its own
# timeout. Writes one JSON summary (per check: name, ok, seconds, key figures, error tail) and prints its path.
#
#   bash scripts/gpu_check.sh                  # scripts/setup.sh first (CUDA torch where nvidia-smi lists a GPU)
#   bash scripts/gpu_check.sh --no-setup       # .venv as it is
#   bash scripts/gpu_check.sh --dry-run        # any machine: list the checks, validate every command, run nothing
#   bash scripts/gpu_check.sh --out PATH       # the summary's path (default outputs/gpu_check/summary-<time>.json)
#   bash scripts/gpu_check.sh -k sft_tiny      # only the checks whose name matches (pytest -k)
#
# Each check's files (recipe, run folder, launch log, export, snapshot) stay in <summary>.work/.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY="" SETUP=1 OUT="" SELECT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=--gpu-dry-run ;;
    --no-setup) SETUP=0 ;;
    --out) OUT=${2:?--out needs a path}; shift ;;
    -k) SELECT=${2:?-k needs an expression}; shift ;;
    -h | --help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (--dry-run, --no-setup, --out PATH, -k EXPR)" >&2; exit 2 ;;
  esac
  shift
done
OUT=${OUT:-outputs/gpu_check/summary-$(date +%Y%m%d-%H%M%S).json}
if [ "$SETUP" = 1 ]; then
  bash scripts/setup.sh || { echo "gpu_check.sh: scripts/setup.sh failed" >&2; exit 1; }
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ -z "$DRY" ] && ! .venv/bin/python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  .venv/bin/python -c "import torch; print(f'gpu_check.sh: torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees no CUDA device')" >&2
  echo "gpu_check.sh: nothing to check here; --dry-run validates the checks on any machine" >&2
  exit 1
fi
mkdir -p "$(dirname "$OUT")"
# --basetemp: pytest empties this folder first; it is named after the summary, so it is this run's own.
.venv/bin/python -m pytest tests/gpu -m gpu -v -p no:cacheprovider --basetemp "${OUT%.json}.work" \
  --gpu-report "$OUT" $DRY ${SELECT:+-k "$SELECT"}
status=$?
echo "GPU check summary: $OUT"
exit $status
