#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: unit, 2-rank gloo distributed, and recipe tests.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check hf_fsdp2 recipes tests bench scripts
.venv/bin/ruff format --check hf_fsdp2 recipes tests bench scripts
.venv/bin/mypy
.venv/bin/python scripts/check_imports.py
.venv/bin/python -m pytest -q --durations=15 "$@"
