#!/usr/bin/env bash
# Soak: N minutes of mixed traffic at a jaxserve server on 127.0.0.1, then a report.
#
#   SOAK_MINUTES=15 bash scripts/soak.sh          # `make soak`
#   SOAK_SECONDS=60 bash scripts/soak.sh          # the profile tests/test_soak.py runs
#   SOAK_URL=http://127.0.0.1:8000 SOAK_PID=1234 bash scripts/soak.sh   # an already running server
#
# Without SOAK_URL it starts `jaxserve serve` on the tiny GGUF fixture (or SOAK_MODEL) on a
# free port (two step programs; a throw-away params cache, the project's compile cache unless
# SOAK_COMPILE_CACHE says otherwise), waits for /health, runs scripts/soak.py (bounded: it stops
# at the deadline), stops the server with SIGTERM and exits with soak.py's status (1 on any
# 5xx, unexpected error, KV blocks left in use, or RSS growth above SOAK_MAX_RSS_GROWTH).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
SECONDS_TOTAL=${SOAK_SECONDS:-$(( ${SOAK_MINUTES:-1} * 60 ))}
MODEL=${SOAK_MODEL:-tests/fixtures/tiny_gguf/tiny-f32.gguf}
REPORT=${SOAK_REPORT:-}
EXTRA=()
if [[ -n "${SOAK_MAX_RSS_GROWTH:-}" ]]; then EXTRA+=(--max_rss_growth="$SOAK_MAX_RSS_GROWTH"); fi

if [[ -z "${SOAK_URL:-}" ]]; then
  WORK=$(mktemp -d /tmp/jaxserve-soak.XXXXXX)
  PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  "$PY" -m jaxserve.cli serve --model="$MODEL" --host=127.0.0.1 --port="$PORT" \
    --params_cache_dir="$WORK/params" --compile_cache_dir="${SOAK_COMPILE_CACHE:-checkpoints/jax_compile_cache}" \
    --max_model_len=128 --num_kv_blocks=256 --block_size=4 --max_num_seqs=8 \
    --max_num_batched_tokens=64 --token_buckets=16,64 --seq_buckets=8 --nounroll_layers \
    --attention_backend=xla ${SOAK_SERVE_ARGS:-} \
    >"$WORK/server.log" 2>&1 &
  SERVER_PID=$!
  trap 'kill -TERM $SERVER_PID 2>/dev/null || true; wait $SERVER_PID 2>/dev/null || true; rm -rf "$WORK"' EXIT
  SOAK_URL="http://127.0.0.1:$PORT"
  SOAK_PID=$SERVER_PID
  HEALTHY=0
  for _ in $(seq 1 600); do   # at most 300 s of warm-up
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then echo "server died:"; tail -30 "$WORK/server.log"; exit 1; fi
    if "$PY" -c "import httpx,sys; sys.exit(httpx.get('$SOAK_URL/health', timeout=2).status_code != 200)" 2>/dev/null; then HEALTHY=1; break; fi
    sleep 0.5
  done
  if [[ $HEALTHY != 1 ]]; then echo "server not healthy after 300 s:" >&2; tail -30 "$WORK/server.log" >&2; exit 1; fi
fi
echo "soak: ${SECONDS_TOTAL} s of mixed traffic at $SOAK_URL (pid ${SOAK_PID:-?}), load: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
set +e
"$PY" scripts/soak.py --url="$SOAK_URL" --seconds="$SECONDS_TOTAL" ${SOAK_PID:+--server_pid=$SOAK_PID} \
  --concurrency="${SOAK_CONCURRENCY:-8}" "${EXTRA[@]}" > "${REPORT:-/dev/stdout}"
RC=$?
set -e
exit $RC
