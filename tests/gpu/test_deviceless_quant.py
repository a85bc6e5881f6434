"""Issue 26: weight-only quantization on a GPU, compiled deviceless (XLA fuses no block
scale into its GEMM). What must hold: per-channel int8 (`--quantization=int8`) reaches the
GEMM fusion as a convert of the int8 weight (its scale applied to the product), and a
decode step's few rows (M <= `linear.REDUCE_MAX_ROWS`) of any block format run as one
reduction over the blocks, so the executable's scratch holds no dequantized copy of the
weight. `scripts/gpu_quant_fusion.py` compiles `quantized_matmul`'s GPU path for a
[4096, 4096] weight and reports the scratch. Needs `.venv-gpu` (skipped without it)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from jaxserve.gpu import venv as gpu_venv

pytestmark = pytest.mark.skipif(not gpu_venv.is_ready(), reason="no .venv-gpu (make gpu-venv)")
ROOT = Path(__file__).resolve().parents[2]


def _compile(target: str, kind: str, m: int) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([str(gpu_venv.python()), str(ROOT / "scripts" / "gpu_quant_fusion.py"),
                        target, kind, str(m)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


WEIGHT = 4096 * 4096 * 2  # the bf16 weight XLA would write


def test_decode_rows_read_every_format_inside_one_fusion():
    for kind in ("q8_0", "q4", "int8"):
        r = _compile("h200", kind, 1)
        assert not r["materialised"] and r["temp_mib"] * 2**20 < WEIGHT / 8, r


def test_per_channel_int8_is_read_inside_the_gemm():
    assert not _compile("a100", "int8", 64)["materialised"]
    assert _compile("a100", "q8_0", 64)["materialised"]  # the check sees a written weight
