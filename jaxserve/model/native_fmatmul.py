"""The native XLA:CPU float matmul at few rows (XLA FFI custom calls over `native/fmatmul.cc`).

XLA:CPU runs a one-row dot at 13-19 GB/s of weight (a single-threaded loop for M = 1), far
from the ~41 GB/s the machine streams (notes/issue26_fp32.md). The kernel splits the weight
over XLA's intra-op pool and the calling thread. Two layouts:
  - "nk": W f32[N, K], y = x @ W^T (the tied LM head over the embedding [V, E]);
  - "kn": W f32[K, N], y = x @ W (the layers' canonical matrices, at up to
    `linear.FLOAT_NATIVE_MAX_ROWS` rows).
Built and cached like the decode-attention kernel (`jaxserve.attention.native_cpu
.NativeKernels`), registered as `jaxserve_fmatmul_nk` / `jaxserve_fmatmul_kn` for CPU.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from jaxserve.attention.native_cpu import NativeKernels


TARGETS = {"nk": "jaxserve_fmatmul_nk", "kn": "jaxserve_fmatmul_kn"}
_SYMBOLS = {"nk": "JaxserveFMatmulNK", "kn": "JaxserveFMatmulKN"}
_SRC = Path(__file__).with_name("native") / "fmatmul.cc"
_KERNELS = NativeKernels(_SRC, "fmatmul", {TARGETS[k]: _SYMBOLS[k] for k in TARGETS},
                         "native CPU float matmul")
available, status = _KERNELS.available, _KERNELS.status  # build + register; cache-key part


def kn_serial_bytes() -> int:
    """Weight bytes below which a "kn" product runs on the calling thread alone (0 when
    the kernel is unavailable)."""
    return _KERNELS.call_int64("JaxserveFMatmulKNSerialBytes")


def set_kn_serial_bytes(nbytes: int) -> int:
    """Weight bytes below which a "kn" product runs on the calling thread alone (default
    512 KiB; 0 threads every product over XLA's intra-op pool), process-wide, for
    measurements that compare both in one process; no recompile, and the result is the
    same either way (the K split does not depend on the threads). Returns the value in
    force (0 when the kernel is unavailable)."""
    return _KERNELS.call_int64("JaxserveFMatmulSetKNSerialBytes", nbytes)


def fmatmul(x: jax.Array, w: jax.Array, *, layout: str) -> jax.Array:
    """y f32[M, N] from x [M, K] (any float dtype, computed in f32) and a float weight.

    Args:
      x: [M, K] activations.
      w: f32[N, K] for layout "nk" (y = x @ w.T) or f32[K, N] for "kn" (y = x @ w).
      layout: "nk" or "kn".

    Raises:
      ValueError: unknown layout, w not 2-D f32, or its K axis differs from x's.
      RuntimeError: `available()` is False.
    """
    if layout not in TARGETS:
        raise ValueError(f"{layout=} not in {sorted(TARGETS)}")
    if w.ndim != 2 or w.dtype != jnp.float32 or x.ndim != 2:
        raise ValueError(f"fmatmul needs x [M, K] and f32 w 2-D, got {x.shape=} {w.shape=} "
                         f"{w.dtype=}")
    k_axis, n_axis = (1, 0) if layout == "nk" else (0, 1)
    if w.shape[k_axis] != x.shape[1]:
        raise ValueError(f"fmatmul {layout}: {x.shape=} does not match {w.shape=}")
    if not available():
        raise RuntimeError(f"native CPU float matmul unavailable: "
                           f"{_KERNELS.unavailable_reason()}")
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[n_axis]), jnp.float32)
    return jax.ffi.ffi_call(TARGETS[layout], out)(x.astype(jnp.float32), w)
