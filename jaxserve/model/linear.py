"""The forward's matrix products, float or quantized, in one place.

`linear(x, w)` is `x @ w` for a float canonical matrix w [K, N], and a dequantize-on-the-
fly product for a `jaxserve.model.quant.QuantizedWeight` (stored [N, K]):
  - on CPU with M <= NATIVE_MAX_ROWS rows, the native FFI kernel (`native_qmatmul`), which
    reads the blocks once (XLA:CPU materialises `dequantize(W)` before its dot);
  - elsewhere (GPU, TPU, large-M prefill on CPU, or no compiler) a mixed-precision
    `dot_general` over the in-graph dequantization, which XLA:GPU fuses into the GEMM's
    operand read (check with `jaxserve compile --target=h200`).
`embed_rows` gathers embedding rows, `head_matrix_product` is the LM head: a tied fp32
head on CPU at <= HEAD_NATIVE_MAX_ROWS rows goes to the native float kernel
(`native_fmatmul`, layout "nk" over the embedding), as does a float layer matrix at
<= FLOAT_NATIVE_MAX_ROWS rows (layout "kn"; 0 = off; notes/issue26_fp32.md, notes/issue26.md),
and `linear_many` runs several of those of one x in one kernel call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.model import native_fmatmul, native_qmatmul
from jaxserve.model.quant import QuantizedWeight

# Rows up to which the CPU path uses the native kernel (decode steps); above it XLA's
# large-M GEMM on the dequantized tile wins (notes/issue26.md).
NATIVE_MAX_ROWS = 64
# Rows up to which a tied fp32 LM head uses the native float kernel on CPU (XLA runs the
# one-row [1, 576] @ [576, 49152] at 13-19 GB/s; notes/issue26_fp32.md), and the same for
# the layers' float matrices (the "kn" kernel: 30 layers' matrices 0.77 / 0.74 / 0.56 /
# 0.81x XLA's time at M = 1 / 2 / 4 / 8, slower from 16; the head 0.22-0.88x at 1-8 rows,
# 1.07x at 16: notes/issue26.md, fourteenth session).
HEAD_NATIVE_MAX_ROWS = 8
FLOAT_NATIVE_MAX_ROWS = 8
# Whether `linear_many` runs several float products of one x in one native call (False: one
# call each; the same bits either way).
FLOAT_NATIVE_MANY = True
# Rows up to which a block-scaled weight's XLA path is `_reduce_dot` (no dequantized copy;
# each extra row re-reads the blocks, so past a few rows the GEMM on a dequantized copy wins).
REDUCE_MAX_ROWS = 4


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
    dims = (((1,), (1,)), ((), ()))
    if w.kind == "q8" and w.block == w.shape[-1]:
        # Per-channel int8: the scale is applied to the product, so only a convert feeds
        # the dot and XLA's GPU GEMM fusion reads the int8 weight itself; a block scale
        # varies along K and makes XLA write the dequantized weight first
        # (scripts/gpu_quant_fusion.py, deviceless H200 / A100).
        y = jax.lax.dot_general(x, w.q.astype(x.dtype), dims,
                                preferred_element_type=jnp.float32)
        return (y * w.scale[..., 0].astype(jnp.float32)).astype(x.dtype)
    if x.shape[0] <= REDUCE_MAX_ROWS and x.ndim == 2 and w.q.ndim == 2:
        return _reduce_dot(x, w)
    wd = dequantize_jnp(w, x.dtype)
    return jax.lax.dot_general(x, wd, dims)


def _reduce_dot(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x [M, K] @ W^T for block-scaled W [N, K] as one broadcast multiply and sum over K,
    for M <= REDUCE_MAX_ROWS: XLA fuses the unpacking, the scales and the products into
    one reduction that reads the blocks once, where the dequantize + dot form writes the
    whole dequantized weight before its GEMM (scripts/gpu_quant_fusion.py)."""
    f32 = jnp.float32
    m, k = x.shape
    n, nb = w.q.shape[0], k // w.block
    xb = x.astype(f32).reshape(m, 1, nb, w.block)
    s = w.scale.astype(f32)[None, :, :, None]
    if w.kind == "q8":
        y = jnp.sum(xb * w.q.reshape(1, n, nb, w.block).astype(f32) * s, axis=(2, 3))
    else:  # ggml's Q4 order: byte j of a block holds element j (low nibble) and j + 16
        pb = w.q.reshape(1, n, nb, w.block // 2)
        lo, hi = (pb & 15).astype(f32), (pb >> 4).astype(f32)
        xl, xh = xb[..., :w.block // 2], xb[..., w.block // 2:]
        y = jnp.sum(s * (xl * lo + xh * hi) + w.min.astype(f32)[None, :, :, None] * (xl + xh),
                    axis=(2, 3))
    return y.astype(x.dtype)


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


def _native_float_fits(x: jax.Array, w: jax.Array, max_rows: int) -> bool:
    return (x.ndim == 2 and w.ndim == 2 and x.shape[0] <= max_rows
            and x.dtype == jnp.float32 and w.dtype == jnp.float32 and native_fmatmul.available())


def float_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x f32[M, K] @ w f32[K, N] -> f32[M, N]: on CPU at M <= FLOAT_NATIVE_MAX_ROWS the native
    "kn" kernel, otherwise (and on every other platform, chosen at lowering) XLA's dot."""
    if not _native_float_fits(x, w, FLOAT_NATIVE_MAX_ROWS):
        return x @ w
    return jax.lax.platform_dependent(
        x, w, cpu=lambda a, b: native_fmatmul.fmatmul(a, b, layout="kn"),
        default=lambda a, b: a @ b)


def linear(x: jax.Array, w) -> jax.Array:
    """x [M, K] times a canonical matrix: float w [K, N] (x @ w) or a QuantizedWeight [N, K]."""
    if isinstance(w, QuantizedWeight):
        return quantized_matmul(x, w)
    return float_matmul(x, w)


def linear_many(x: jax.Array, ws) -> tuple[jax.Array, ...]:
    """(linear(x, w) for w in ws), e.g. q, k and v of one normed x. Float weights that would
    each take the native "kn" kernel (CPU, M <= FLOAT_NATIVE_MAX_ROWS) take it in one call
    (`native_fmatmul.fmatmul_many`: one wake-up of the pool, the same bits as one call each;
    the weights stay separate leaves, so XLA's dots above that many rows are untouched).
    Otherwise, i.e. if any weight would not (quantized, bf16, more rows), every
    weight goes through `linear` on its own."""
    ws = tuple(ws)
    if (not FLOAT_NATIVE_MANY or len(ws) < 2 or len(ws) > native_fmatmul.MAX_PRODUCTS
            or not all(isinstance(w, jax.Array) and _native_float_fits(x, w, FLOAT_NATIVE_MAX_ROWS)
                       for w in ws)):
        return tuple(linear(x, w) for w in ws)
    return tuple(jax.lax.platform_dependent(
        x, *ws, cpu=lambda a, *b: native_fmatmul.fmatmul_many(a, b),
        default=lambda a, *b: tuple(a @ w for w in b)))


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
    if not tied:
        return float_matmul(hidden, w)
    if not _native_float_fits(hidden, w, HEAD_NATIVE_MAX_ROWS):
        return _xla_tied_head(hidden, w)
    return jax.lax.platform_dependent(
        hidden, w, cpu=lambda h, e: native_fmatmul.fmatmul(h, e, layout="nk"),
        default=_xla_tied_head)


def _xla_tied_head(hidden: jax.Array, embed: jax.Array) -> jax.Array:
    """hidden [S, E] @ embed[V, E]^T by XLA. One row is padded to two: XLA:CPU lowers a
    one-row dot to a single-threaded loop (14 ms for [49152, 576] vs 6 ms for two rows,
    notes/perf.md)."""
    if hidden.shape[0] == 1:
        return (jnp.pad(hidden, ((0, 1), (0, 0))) @ embed.T)[:1]
    return hidden @ embed.T
