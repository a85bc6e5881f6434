#!/usr/bin/env bash
# Regenerate the HF golden fixtures in tests/fixtures/ (run by `make fixtures`).
#
# Uses a separate Python 3.11 venv with torch + transformers (the jaxserve
# venv ships no torch), so the golden numbers come from an independent
# implementation: HF transformers' LlamaForCausalLM on CPU in float32.
# Arguments go to make_golden.py: `scripts/make_fixtures.sh --only smollm2_greedy32`
# rewrites tests/fixtures/smollm2/greedy32_golden.json (issue 26) and, as always, the
# chat-template golden.
set -euo pipefail
cd "$(dirname "$0")/.."

PY311="${PY311:-}"
if [[ -z "$PY311" ]]; then
  for p in /root/.pyenv/versions/3.11.7/bin/python3.11 python3.11 python3; do
    if "$p" -c 'import sys; assert sys.version_info[:2] == (3, 11)' >/dev/null 2>&1; then PY311="$p"; break; fi
  done
fi
[[ -n "$PY311" ]] || { echo "error: Python 3.11 not found (set PY311=...)"; exit 1; }

VENV=checkpoints/fixture_venv
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PY311" -m venv "$VENV"
fi
if [[ ! -f "$VENV/.installed" ]]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q torch==2.13.0
  "$VENV/bin/python" -m pip install -q transformers accelerate gguf safetensors numpy tokenizers jinja2 sentencepiece protobuf
  touch "$VENV/.installed"
fi

# The real-model fixtures need the default GGUF.
MODEL=checkpoints/SmolLM2-135M-Instruct.Q4_1.gguf
if [[ ! -f "$MODEL" ]]; then
  .venv/bin/python -m jaxserve.checkpoint.fetch --dest checkpoints
fi

"$VENV/bin/python" scripts/make_golden.py --out tests/fixtures --model "$MODEL" "$@"
"$VENV/bin/python" scripts/make_chat_template_golden.py --out tests/fixtures --model "$MODEL"
