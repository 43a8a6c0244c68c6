#!/usr/bin/env bash
# The proof of a refactor: the same short 2-rank CPU runs of every recipe (SFT plain/LoRA/packed, CPT, DPO
# sigmoid/precomputed reference/LoRA, IPO, SimPO, ORPO, KTO, reward model, GRPO) at REF and in the working tree (or at
# a second ref) must log bit-identical losses and grad norms and export equal weights. bench/same_losses.py does the work.
#   bash scripts/same_losses.sh 77cd9fa                # 77cd9fa vs the working tree
#   bash scripts/same_losses.sh HEAD~20 HEAD           # two refs
#   bash scripts/same_losses.sh HEAD~5 --paths dpo --keep /tmp/same   # one path, runs' logs kept
# Exit status: 0 identical, 1 a value differs, 2 a side cannot run (the error names it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || { echo "same_losses: no $(pwd)/.venv: run scripts/setup.sh first" >&2; exit 2; }
[ $# -ge 1 ] || { echo "usage: bash scripts/same_losses.sh REF [NEW_REF] [--paths plain,lora,packed,cpt,dpo,dpo_precompute,dpo_lora,ipo,simpo,orpo,kto,rm,grpo] [--keep DIR]" >&2; exit 2; }
exec "$PY" bench/same_losses.py "$@"
