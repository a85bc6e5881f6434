"""Shared fixtures for checkpoint tests: fixture paths and a GGUF re-writer."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
import pytest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TINY_GGUF_F32 = FIXTURES / "tiny_gguf" / "tiny-f32.gguf"
Q = gguf.GGMLQuantizationType


def rewrite_gguf(src: Path, dst: Path, *, arch: str = "llama", drop: tuple[str, ...] = (),
                 retype: dict[str, Q] | None = None,
                 raw: dict[str, tuple[np.ndarray, Q]] | None = None,
                 fields: dict[str, Any] | None = None) -> Path:
    """Copy a GGUF file with changes: architecture name (llama.* keys renamed), dropped
    tensors, tensors re-quantized (`retype`) or replaced by raw bytes (`raw`), and
    metadata overrides (`fields`: key -> (value, GGUFValueType))."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        key = f"{arch}." + name[len("llama."):] if name.startswith("llama.") else name
        if fields and key in fields:
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    for key, (val, vtype) in (fields or {}).items():
        w.add_key_value(key, val, vtype)
    for t in r.tensors:
        if t.name in drop:
            continue
        if raw and t.name in raw:
            data, qt = raw[t.name]
            w.add_tensor(t.name, data, raw_dtype=qt)
            continue
        a = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        qt = (retype or {}).get(t.name, Q.F32)
        if qt == Q.F32:
            w.add_tensor(t.name, np.ascontiguousarray(a, dtype=np.float32))
        else:
            w.add_tensor(t.name, gguf.quants.quantize(a.astype(np.float32), qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture
def gguf_rewriter(tmp_path) -> Callable[..., Path]:
    def make(name: str = "x.gguf", src: Path = TINY_GGUF_F32, **kw) -> Path:
        return rewrite_gguf(src, tmp_path / name, **kw)
    return make


def max_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())
