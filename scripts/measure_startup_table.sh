#!/usr/bin/env bash
# Issue 12's start-up table in one go: `make generate`'s command cold and cached, then
# `jaxserve serve` at the default flags and at --max_num_seqs=16, each cold (empty
# compile, params and executable caches) and cached (all three warm from the cold run).
#
#   scripts/measure_startup_table.sh [OUT_DIR]      # default /tmp/jaxserve_startup
#
# Serve rows come from scripts/measure_startup.py (one JSON line each: healthy, first
# token, params ready, all programs ready, uptime before/after; also appended to
# OUT/serve.jsonl). Generate rows are
# wall seconds from the command to its printed summary. Run it on a quiet machine:
# the load is printed with every row.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/jaxserve_startup}
PY=${PY:-.venv/bin/python}
JS=${JS:-.venv/bin/jaxserve}
mkdir -p "$OUT"

gen() {  # gen LABEL DIR: one `make generate` command on the caches under DIR
    local label=$1 d=$2 s e
    echo "generate $label: start, $(uptime)"
    s=$(date +%s.%N)
    "$JS" generate --prompts_file=examples/prompts.jsonl --max_tokens=64 --max_num_seqs=8 \
        --compile_cache_dir="$d/cc" --params_cache_dir="$d/pc" --executable_cache_dir="$d/ec" \
        --print_outputs=false > "$OUT/generate_$label.log" 2>&1
    e=$(date +%s.%N)
    echo "generate $label: $(echo "$e - $s" | bc) s to the summary, $(uptime)"
    grep -E "warm-up:|generated|tok/s" "$OUT/generate_$label.log" | tail -3 || true
}

rm -rf "$OUT/gen"
gen cold "$OUT/gen"
gen cached "$OUT/gen"
for flags in "" "--max_num_seqs=16"; do
    name=d${flags##*=}
    "$PY" scripts/measure_startup.py --label "serve_${name}_cold" --dir "$OUT/$name" --cold \
        ${flags:+-- $flags} | tee -a "$OUT/serve.jsonl"
    "$PY" scripts/measure_startup.py --label "serve_${name}_cached" --dir "$OUT/$name" \
        ${flags:+-- $flags} | tee -a "$OUT/serve.jsonl"
done
