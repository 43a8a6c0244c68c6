#!/usr/bin/env bash
# Build an offline install bundle (default offline_bundle/) on a connected machine, for an air-gapped node
# that has its own Python and CUDA torch but no package index: wheels of hf_fsdp2's runtime dependencies
# that the node lacks (datasets, dill, multiprocess, ...), liger-kernel, torchao, and the hf_fsdp2 wheel; never torch,
# triton, nvidia-* or cuda-*. Pins are the versions of this checkout's .venv (where the tests pass). Prints
# each wheel and the total; fails above --max-mib (64 MiB). scripts/offline_bundle.py says how it works.
#
#   python3 -m pip freeze > node-freeze.txt                       # on the node
#   bash scripts/offline_bundle.sh --python-version 3.12 --have node-freeze.txt   # here
#   options: --dest DIR  --platform manylinux_2_28_x86_64  --extra PKG (repeat; `none`)  --no-project  --max-mib N
#
# Copy offline_bundle/ next to the checkout on the node, then either
#   (a) install (the node's torch is kept: torch is never in the bundle, and pip keeps what satisfies):
#       python3 -m pip install --no-index --find-links offline_bundle hf_fsdp2
#   (b) with a read-only python, install nothing into it: unpack the exact pins into a folder and put it on
#       PYTHONPATH (what scripts/gpu_check.sh --offline does; the checkout first to run its own code):
#       python3 -m pip install --no-index --no-deps --target .offline_site -r offline_bundle/requirements.txt
#       export PYTHONPATH=$PWD:$PWD/.offline_site
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
exec "$PY" scripts/offline_bundle.py "$@"
