#!/usr/bin/env bash
# jaxserve against llama.cpp's llama-server, side by side, on this machine (issue 11).
#
#   scripts/bench_vs_llamacpp.sh                     # N=8,16 x seed8/ragged64, burst and arrivals
#   scripts/bench_vs_llamacpp.sh --profile=short     # a two-minute smoke test
#   scripts/bench_vs_llamacpp.sh --profile=issue --llama_server=PATH   # skip the llama.cpp build
#   PYTHON=/other/venv/bin/python scripts/bench_vs_llamacpp.sh ...
#
# The logic is `jaxserve bench compare` (jaxserve/bench/compare.py; --help lists
# every flag). `exec` hands signals straight to it: it stops both servers by PID
# on every exit path (finally + SIGTERM/SIGHUP handlers + PR_SET_PDEATHSIG).
# Not part of `make test`: a full run takes 20-40 minutes on 2 cores.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[[ -x "$PY" ]] || { echo "error: $PY not found (run \`make setup\`, or set PYTHON=)" >&2; exit 2; }
command -v uptime >/dev/null || { echo "error: \`uptime\` (procps) is needed to record the load" >&2; exit 2; }
exec "$PY" -m jaxserve.bench.compare "$@"
