"""The native XLA:CPU quantized matmul (XLA FFI custom calls over `native/qmatmul.cc`).

XLA:CPU given `x @ dequantize(W)` materialises the dequantized weight (a convert +
multiply fusion writes the f32 matrix, then the dot reads it back: notes/issue26.md),
so a quantized weight would move more bytes than an fp32 one. The kernel reads the
blocks once and dequantizes them in registers, as llama.cpp's vec_dot kernels do.
Built and cached like the decode-attention kernel (`jaxserve.attention.native_cpu
.NativeKernels`), registered as `jaxserve_qmatmul_q8` / `jaxserve_qmatmul_q4` for CPU.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.attention.native_cpu import NativeKernels


TARGETS = {"q8": "jaxserve_qmatmul_q8", "q4": "jaxserve_qmatmul_q4"}
_SYMBOLS = {"q8": "JaxserveQMatmulQ8", "q4": "JaxserveQMatmulQ4"}
_SRC = Path(__file__).with_name("native") / "qmatmul.cc"
_KERNELS = NativeKernels(_SRC, "qmatmul", {TARGETS[k]: _SYMBOLS[k] for k in TARGETS},
                         "native CPU quantized matmul")
available, status = _KERNELS.available, _KERNELS.status  # build + register; cache-key part


INT_PATHS = {0: "", 1: "avx2", 2: "avx512_vnni"}


def int_path() -> str:
    """Which integer path the kernel was built with for this CPU: "avx512_vnni" (vpdpbusd,
    `native/qmatmul_int.h`), "avx2" (vpmaddwd, `native/qmatmul_int_avx2.h`) or "" (none:
    no AVX2 + FMA + F16C, or the kernel is unavailable). Both multiply the same
    quantization of x (`quantize_x`)."""
    return INT_PATHS[_KERNELS.call_int64("JaxserveQMatmulIntPath")]


def int_rows(kind: str = "q4") -> int:
    """Rows of x up to which the kernel quantizes x to two int8 digits per 32-element
    block and uses integer dot products on `kind` ("q4", "q8" for 32-element blocks, or
    "int8": per-channel, one scale a row) weights (0: it keeps x in f32, i.e. no integer
    path on this CPU, or the kernel is unavailable). Defaults, from their measured
    crossovers against the f32 kernels (the kernel's source): q4 16 and q8 / int8 4 on the
    AVX-512 VNNI path; q4 and q8 8, int8 3 on the AVX2 one (`int_path`).
    `quantize_x` gives that quantization's values.

    Raises:
      ValueError: an unknown kind.
    """
    names = {"q4": "JaxserveQMatmulIntRows", "q8": "JaxserveQMatmulIntRowsQ8",
             "int8": "JaxserveQMatmulIntRowsInt8"}
    if kind not in names:
        raise ValueError(f"kind={kind!r} must be one of {tuple(names)}")
    return _KERNELS.call_int64(names[kind])


def set_int_rows(rows: int) -> int:
    """Set the process-wide q4 `int_rows` (clamped to [0, 64]; q8 and int8 use at most 4 of
    them, 8 and 3 on the AVX2 path; 0 runs the f32-activation kernels), for measurements
    that compare both paths in one process (scripts/measure_quant_drift.py); compiled
    programs need no recompile. Returns the value in force."""
    return _KERNELS.call_int64("JaxserveQMatmulSetIntRows", rows)


def serial_work() -> int:
    """Multiply-adds (M * N * K) below which the kernel runs a product on the calling
    thread alone (above: XLA's intra-op pool helps); 0 if the kernel is unavailable."""
    return _KERNELS.call_int64("JaxserveQMatmulSerialWork")


def set_serial_work(work: int) -> int:
    """Set the process-wide `serial_work` (>= 0; 0 threads every product), for
    measurements in one process; no recompile. Returns the value in force."""
    return _KERNELS.call_int64("JaxserveQMatmulSetSerialWork", work)


def quantize_x(x: np.ndarray) -> np.ndarray:
    """The values the kernel's integer path multiplies for x f32[M, K] (K % 32 == 0), as
    float64 [M, K] (the reference of `native/qmatmul.cc` QuantizeX): per 32-element block,
    d = amax / 127, v = x * (127 / amax) in f32, hi = rint(v),
    lo = min(rint((v - hi) * 256), 127), x' = d * hi + (d / 256) * lo;
    |x' - x| <= d / 512 (d / 256 on an exact tie): about 1.6e-5 of the block's amax.

    Raises:
      ValueError: K is not a multiple of 32."""
    m, k = x.shape
    if k % 32:
        raise ValueError(f"quantize_x: K={k} is not a multiple of 32")
    b = np.asarray(x, np.float32).reshape(m, k // 32, 32)
    amax = np.abs(b).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    d = (amax / np.float32(127)).astype(np.float32)
    v = (b * inv).astype(np.float32)
    hi = np.rint(v)
    lo = np.minimum(np.rint((v - hi) * np.float32(256)), 127)
    xq = d.astype(np.float64) * hi + (d / np.float32(256)).astype(np.float64) * lo
    return xq.reshape(m, k)


def qmatmul(x: jax.Array, q: jax.Array, scale: jax.Array, mn: jax.Array | None, *, kind: str,
            block: int) -> jax.Array:
    """y f32[M, N] = x[M, K] @ W[N, K]^T for one 2-D quantized weight (see quant.py).

    Raises:
      RuntimeError: `available()` is False.
      (At run time the call fails naming the shapes if they do not agree.)
    """
    if not available():
        raise RuntimeError(f"native CPU quantized matmul unavailable: "
                           f"{_KERNELS.unavailable_reason()}")
    out = jax.ShapeDtypeStruct((x.shape[0], q.shape[0]), jnp.float32)
    args = (x.astype(jnp.float32), q, scale) + ((mn,) if kind == "q4" else ())
    return jax.ffi.ffi_call(TARGETS[kind], out)(*args, block=np.int64(block))
