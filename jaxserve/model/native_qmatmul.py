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
