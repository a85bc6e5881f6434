"""The native XLA:CPU float matmul at few rows (XLA FFI custom calls over `native/fmatmul.cc`).

XLA:CPU runs a one-row dot at 13-19 GB/s of weight (a single-threaded loop for M = 1), far
from the ~41 GB/s the machine streams (notes/issue26_fp32.md). The kernel splits the weight
over XLA's intra-op pool and the calling thread. Two layouts:
  - "nk": W f32[N, K], y = x @ W^T (the tied LM head over the embedding [V, E]);
  - "kn": W f32[K, N], y = x @ W (the layers' canonical matrices, at up to
    `linear.FLOAT_NATIVE_MAX_ROWS` rows).
`fmatmul_many` runs several "kn" products of one x in one call (q, k and v; gate and up):
one wake-up of the pool for all of them, the same bits as one call each.
Built and cached like the decode-attention kernel (`jaxserve.attention.native_cpu
.NativeKernels`), registered as `jaxserve_fmatmul_nk` / `jaxserve_fmatmul_kn` /
`jaxserve_fmatmul_kn_many` for CPU.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from jaxserve.attention.native_cpu import NativeKernels


TARGETS = {"nk": "jaxserve_fmatmul_nk", "kn": "jaxserve_fmatmul_kn"}
_SYMBOLS = {"nk": "JaxserveFMatmulNK", "kn": "JaxserveFMatmulKN"}
MANY_TARGET = "jaxserve_fmatmul_kn_many"
MAX_PRODUCTS = 4  # fmatmul.cc kMaxProducts
_SRC = Path(__file__).with_name("native") / "fmatmul.cc"
_KERNELS = NativeKernels(_SRC, "fmatmul", {**{TARGETS[k]: _SYMBOLS[k] for k in TARGETS},
                                           MANY_TARGET: "JaxserveFMatmulKNMany"},
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


def set_stream_order(on: bool) -> bool:
    """Whether the kernel reads W in the orders that stream it best (the default) or by
    its register tiles alone (the order before them): "kn" at one row of x
    streams W's rows one after another and from 5 rows reads each chunk of W once (8 rows
    at a time); "nk" up to 4 rows takes W one row at a time (one sequential stream a
    thread, where the tiles read 8 or 4 interleaved ones; at one row on this machine's two
    cores kn 1.07x, nk 1.3-1.4x, notes/issue26.md).
    Process-wide, for measurements that compare both in one process; no recompile, and
    the results are the same bits either way. Returns the setting in force (False when
    the kernel is unavailable)."""
    return bool(_KERNELS.call_int64("JaxserveFMatmulSetStreamOrder", int(on)))


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


def fmatmul_many(x: jax.Array, ws: "tuple[jax.Array, ...] | list[jax.Array]"
                 ) -> tuple[jax.Array, ...]:
    """(x @ w for w in ws) in one call of the "kn" kernel: y_j f32[M, N_j] from x [M, K]
    (any float dtype, computed in f32) and f32 weights w_j [K, N_j]. Each product is split
    along K exactly as `fmatmul(x, w, layout="kn")` splits it, so its bits are the same;
    the tasks of all of them share one wake-up of XLA's intra-op pool (for SmolLM2's
    442 KB k and v, which alone run on the calling thread, and the 7 calls a layer that
    become 4).

    Raises:
      ValueError: no weight or more than MAX_PRODUCTS, a weight not 2-D f32, or one whose
        K differs from x's.
      RuntimeError: `available()` is False.
    """
    ws = tuple(ws)
    if not 1 <= len(ws) <= MAX_PRODUCTS or x.ndim != 2:
        raise ValueError(f"fmatmul_many needs x [M, K] and 1..{MAX_PRODUCTS} weights, got "
                         f"{x.shape=} and {len(ws)} weights")
    for w in ws:
        if w.ndim != 2 or w.dtype != jnp.float32 or w.shape[0] != x.shape[1]:
            raise ValueError(f"fmatmul_many: {x.shape=} needs f32 weights [{x.shape[1]}, N], "
                             f"got {w.shape=} {w.dtype=}")
    if not available():
        raise RuntimeError(f"native CPU float matmul unavailable: "
                           f"{_KERNELS.unavailable_reason()}")
    outs = tuple(jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32) for w in ws)
    return tuple(jax.ffi.ffi_call(MANY_TARGET, outs)(x.astype(jnp.float32), *ws))
