#!/usr/bin/env bash
# GPU readiness check of the ragged paged attention kernels (see scripts/gpu_check.py).
#   bash scripts/gpu_check.sh            # on a GPU machine; < 5 min; non-zero exit on mismatch
#   bash scripts/gpu_check.sh --dry-run  # CPU, tiny shapes, Pallas interpreters
# On the lent GPU machine there is no project venv: its own python3 (jax 0.11.2 with
# the CUDA plugins) runs the project source through PYTHONPATH. The JSON goes to
# $OUT/gpu_check.json there (or --json PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PY:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 300 "$PY" -W "ignore:The Pallas Triton backend is deprecated" scripts/gpu_check.py "$@"
