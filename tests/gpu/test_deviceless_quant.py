"""Issue 26: weight-only quantization on a GPU, compiled deviceless. Per-channel int8
(`--quantization=int8`) must reach XLA's GEMM fusion as a convert of the int8 weight (its
scale applied to the product), so the executable's scratch holds no dequantized copy of
the weight: `scripts/gpu_quant_fusion.py` compiles `quantized_matmul`'s GPU path for a
[4096, 4096] weight and reports the scratch. (Block formats, Q8_0 / Q4_1, still make XLA
write the dequantized weight first: BUILD_NOTES.) Needs `.venv-gpu` (skipped without it)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from jaxserve.gpu import venv as gpu_venv

pytestmark = pytest.mark.skipif(not gpu_venv.is_ready(), reason="no .venv-gpu (make gpu-venv)")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("target,m", [("h200", 1), ("a100", 64)])
def test_per_channel_int8_is_read_inside_the_gemm(target, m):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    out = {}
    for kind in ("int8", "q8_0"):
        p = subprocess.run([str(gpu_venv.python()), str(ROOT / "scripts" / "gpu_quant_fusion.py"),
                            target, kind, str(m)], capture_output=True, text=True, env=env,
                           timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        out[kind] = json.loads(p.stdout.strip().splitlines()[-1])
    weight = 4096 * 4096 * 2  # the bf16 weight XLA would write
    assert not out["int8"]["materialised"] and out["int8"]["temp_mib"] * 2**20 < weight / 2
    assert out["q8_0"]["materialised"]  # the check can see a written weight (block scales)
