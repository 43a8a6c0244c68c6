#!/usr/bin/env bash
# Set up (idempotent), lint, type-check and run the tests.
#   bash scripts/test.sh            everything: unit, 2-rank gloo distributed and recipe tests (what CI runs)
#   bash scripts/test.sh --quick    the edit loop: lint, types, unit tests (not `slow`) and one 2-rank end-to-end smoke
# Other arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"` or `bash scripts/test.sh tests/unit -x`.
# The tests run on HF_FSDP2_TEST_WORKERS parallel pytest workers (default 2, 1 = no xdist), whole files per
# worker (--dist loadfile: a file's module fixtures are built once), each in-process test on one thread.
# Each worker forks its tests' 2-rank runs from a launch server that has imported torch and the recipes once
# (tests/support/launch_server.py); HF_FSDP2_TEST_LAUNCH_SERVER=0 launches every run with torchrun, as a user does.
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
if [ "${1:-}" = "--quick" ]; then
  quick=1
  shift
fi
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Bytecode is written at a module's first import (scripts/setup.sh does not compile site-packages ahead): with
# PYTHONDONTWRITEBYTECODE set, every new interpreter of the suite would compile torch, transformers and hf_fsdp2 again.
unset PYTHONDONTWRITEBYTECODE
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
.venv/bin/ruff check hf_fsdp2 recipes tests bench scripts
.venv/bin/ruff format --check hf_fsdp2 recipes tests bench scripts
.venv/bin/mypy
.venv/bin/python scripts/check_imports.py
workers=${HF_FSDP2_TEST_WORKERS:-2}
parallel=()
if [ "$workers" -gt 1 ]; then
  # --no-loadscope-reorder: xdist would otherwise hand out the files with the most tests first, undoing the
  # longest-first order of tests/conftest.py (a long file of few tests would start last and run alone).
  parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
fi
if [ "$quick" = 1 ]; then
  .venv/bin/python -m pytest -q "${parallel[@]}" -m "not slow" tests/unit \
    tests/recipes/test_sft_recipe.py::test_accelerate_launch_trains_and_exports_a_loadable_folder "$@"
else
  .venv/bin/python -m pytest -q "${parallel[@]}" --durations=25 "$@"
fi
