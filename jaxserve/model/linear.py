"""The forward's matrix products, float or quantized, in one place.

`linear(x, w)` is `x @ w` for a float canonical matrix w [K, N], and a dequantize-on-the-
fly product for a `jaxserve.model.quant.QuantizedWeight` (stored [N, K]):
  - on CPU with M <= NATIVE_MAX_ROWS rows, the native FFI kernel (`native_qmatmul`), which
    reads the blocks once (XLA:CPU materialises `dequantize(W)` before its dot);
  - elsewhere (GPU, TPU, large-M prefill on CPU, or no compiler) a mixed-precision
    `dot_general` over the in-graph dequantization, which XLA:GPU fuses into the GEMM's
    operand read (check with `jaxserve compile --target=h200`).
`embed_rows` gathers embedding rows, `head_matrix_product` is the LM head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.model import native_qmatmul
from jaxserve.model.quant import QuantizedWeight

# Rows up to which the CPU path uses the native kernel (decode steps); above it XLA's
# large-M GEMM on the dequantized tile wins (notes/issue26.md).
NATIVE_MAX_ROWS = 64


def dequantize_jnp(w: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """In-graph dequantization of a [..., N, K] quantized weight (the `quant.dequantize`
    formula in jnp)."""
    *lead, n, _ = w.q.shape
    if w.kind == "q8":
        b = w.q.reshape(*lead, n, -1, w.block).astype(dtype)
        return (b * w.scale[..., None].astype(dtype)).reshape(w.shape)
    pb = w.q.reshape(*lead, n, -1, 16)
    nib = jnp.concatenate([pb & 15, pb >> 4], axis=-1).astype(dtype)
    return (nib * w.scale[..., None].astype(dtype)
            + w.min[..., None].astype(dtype)).reshape(w.shape)


def _native_fits(m: int, w: QuantizedWeight) -> bool:
    return (m <= NATIVE_MAX_ROWS and w.block % 32 == 0 and w.shape[-1] % 32 == 0
            and native_qmatmul.available())


def _native(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    y = native_qmatmul.qmatmul(x, w.q, w.scale, w.min, kind=w.kind, block=w.block)
    return y.astype(x.dtype)


def _dequant_dot(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    wd = dequantize_jnp(w, x.dtype)
    return jax.lax.dot_general(x, wd, (((1,), (1,)), ((), ())))


def quantized_matmul(x: jax.Array, w: QuantizedWeight, *, native: bool | None = None
                     ) -> jax.Array:
    """x [M, K] @ W^T for W [N, K] quantized -> [M, N] in x.dtype.

    native: force the native CPU kernel (True) or the dequantize + dot path (False).
    None: `jax.lax.platform_dependent` picks at lowering time, so one trace serves both
    a CPU program (the native kernel, when M <= NATIVE_MAX_ROWS and it builds) and a GPU
    one (the dequantize + dot path; also what a deviceless GPU compile lowers).
    """
    if native is True:
        return _native(x, w)
    if native is False or not _native_fits(x.shape[0], w):
        return _dequant_dot(x, w)
    return jax.lax.platform_dependent(x, w, cpu=_native, default=_dequant_dot)


def linear(x: jax.Array, w) -> jax.Array:
    """x [M, K] times a canonical matrix: float w [K, N] (x @ w) or a QuantizedWeight [N, K]."""
    if isinstance(w, QuantizedWeight):
        return quantized_matmul(x, w)
    return x @ w


def embed_rows(embed, ids: jax.Array) -> jax.Array:
    """Rows ids i32[T] of the embedding [V, E] (float, or quantized: only those rows are
    dequantized)."""
    if isinstance(embed, QuantizedWeight):
        return dequantize_jnp(embed.map(lambda a: a[ids]))
    return embed[ids]


def head_matrix_product(hidden: jax.Array, w, *, tied: bool) -> jax.Array:
    """hidden [S, E] -> logits [S, V]: tied uses the embedding [V, E] (float: embed.T),
    untied the lm_head (float [E, V]; quantized, stored [V, E])."""
    if isinstance(w, QuantizedWeight):
        return quantized_matmul(hidden, w)
    return hidden @ (w.T if tied else w)
