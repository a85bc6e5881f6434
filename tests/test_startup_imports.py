"""Start-up imports (issue 12): the path from `jaxserve serve|generate` to the params on the
device does not import what it does not run (flax ~1 s, jax.experimental.pallas ~0.6 s,
orbax ~0.4 s on this CPU; notes/params_startup.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests/fixtures/tiny_gguf/tiny-f32.gguf"
AVOIDED = ("flax", "orbax", "jax.experimental.pallas", "transformers", "torch", "llguidance")


def test_engine_start_path_avoids_heavy_imports(tmp_path):
    """The CLI's modules, the server, a params-cache miss and hit, and a built engine
    (xla backend, no warm-up): none of AVOIDED is imported; `Llama` still resolves after."""
    code = f"""
import json, sys
import jaxserve.cli, jaxserve.server
from jaxserve.checkpoint import load_model
from jaxserve.engine import LLMEngine, make_engine_config
for _ in range(2):  # a miss (convert + save), then a hit (memory-mapped)
    cfg, params, tok = load_model({str(TINY)!r}, cache_dir={str(tmp_path / 'pc')!r}, progress=False)
config = make_engine_config(cfg, max_model_len=64, num_kv_blocks=16, block_size=4, max_num_seqs=4,
                            max_num_batched_tokens=16, token_buckets=(16,), seq_buckets=(4,),
                            attention_backend="auto")
engine = LLMEngine(config, params, tok, warmup=False)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {{a.split(".")[0] for a in {AVOIDED!r}}})
print(json.dumps([m for m in loaded if any(m == a or m.startswith(a + ".") for a in {AVOIDED!r})]))
from jaxserve.model.llama import Llama
print(Llama.__module__)
"""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert json.loads(lines[-2]) == []
    assert lines[-1] == "jaxserve.model.nnx"
