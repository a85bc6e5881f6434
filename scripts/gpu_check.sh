#!/usr/bin/env bash
# GPU readiness check of the ragged paged attention (see scripts/gpu_check.py).
#   bash scripts/gpu_check.sh            # on a GPU machine; < 5 min; non-zero exit on mismatch
#   bash scripts/gpu_check.sh --dry-run  # CPU, tiny shapes, Pallas interpret mode
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
exec timeout 300 "$PY" -W "ignore:The Pallas Triton backend is deprecated" scripts/gpu_check.py "$@"
