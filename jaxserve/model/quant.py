"""Weight-only quantized matrices that stay quantized on the device (issue 26).

A `QuantizedWeight` holds one linear layer's matrix (or the stacked [L] matrices) as
llama.cpp's block formats do (ggml `block_q8_0` / `block_q4_0` / `block_q4_1`, Gerganov
et al., llama.cpp): the contraction axis K is cut into blocks of `block` elements, each
with its own f16 scale (and, for 4-bit, an f16 offset), as ggml stores them:

  kind "q8": q int8[..., N, K],    w = scale[n, k // block] * q[n, k]
  kind "q4": q uint8[..., N, K/2], w = scale[n, k // block] * nib[n, k] + min[n, k // block]
             (nibbles in ggml's order: byte j of a 32-block holds element j in its low
             nibble and element j + 16 in its high one)

Rows are the matrix's *output* channels (N) and blocks run along its *input* (K), so a
GGUF tensor's bytes map onto it without any repacking. The canonical parameter tree's
float matrices are [in, out] = [K, N]; a quantized leaf is stored [N, K] (the embedding
[V, E] is already [N, K] for the tied LM head). Q4_0's `d * (q - 8)` is kept as
scale = d, min = -8 d, which is bit-identical in f32 (d * q and 8 d are exact).
Dequantization converts the f16 scales to f32 (exact) and multiplies in f32, as ggml.

The scheme names follow vLLM's `--quantization` flag: `SCHEMES`; `resolve_scheme` turns
one into what is kept / quantized for a given checkpoint, and `quantize_tree` applies it
to float leaves (never requantizing a quantized leaf to fewer bits).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import numpy as np

from jaxserve.config import QUANTIZATION_SCHEMES

# --quantization values (vLLM's flag name). auto: the checkpoint's own quantization.
SCHEMES = QUANTIZATION_SCHEMES
# Canonical tree keys that are matrices a quantized leaf may replace.
LINEAR_KEYS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
TOP_KEYS = ("embed", "lm_head")
Q4_BLOCK = 32
Q8_0_BLOCK = 32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A block-quantized [..., N, K] matrix (see the module docstring for the formats).

    Fields:
      q: int8[..., N, K] ("q8") or uint8[..., N, K // 2] ("q4", two nibbles a byte).
      scale: f16[..., N, K // block].
      min: f16[..., N, K // block] for "q4"; None for "q8".
      kind: "q8" | "q4" (static: part of the tree structure, hence of every program key).
      block: elements per block along K (static); 32 for q4 and Q8_0, K for per-channel int8.
    """

    q: Any
    scale: Any
    min: Any
    kind: str = dataclasses.field(metadata=dict(static=True))
    block: int = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        """The stored matrix's logical shape (..., N, K)."""
        *lead, n, kq = self.q.shape
        return (*lead, n, kq * 2 if self.kind == "q4" else kq)

    @property
    def dtype(self):
        """The dtype it dequantizes to: f32."""
        return np.dtype(np.float32)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.q, self.scale, self.min) if a is not None)

    def layer(self, i: int) -> "QuantizedWeight":
        """Layer i of a stacked [L, N, K] weight."""
        return QuantizedWeight(self.q[i], self.scale[i], None if self.min is None else self.min[i],
                               self.kind, self.block)

    def map(self, fn) -> "QuantizedWeight":
        """fn applied to each array field (q, scale, min)."""
        return QuantizedWeight(fn(self.q), fn(self.scale), None if self.min is None else fn(self.min),
                               self.kind, self.block)


def is_quantized(x: Any) -> bool:
    return isinstance(x, QuantizedWeight)


def _blocks(w: np.ndarray, block: int) -> np.ndarray:
    n, k = w.shape[-2:]
    if k % block:
        raise ValueError(f"cannot quantize a [..., {n}, {k}] matrix in blocks of {block}: "
                         f"K={k} is not a multiple of {block}")
    return w.reshape(*w.shape[:-1], k // block, block)


def quantize_q8(w: np.ndarray, block: int = Q8_0_BLOCK) -> QuantizedWeight:
    """Float [..., N, K] -> "q8" blocks, as ggml's `quantize_row_q8_0_ref`: d = amax / 127
    stored as f16, q = round(w / d) (with the stored d, so |w - d q| <= d / 2). block = K
    gives per-channel int8 (one scale per output row).

    Raises:
      ValueError: K is not a multiple of block.
    """
    b = _blocks(np.asarray(w, np.float32), block)
    d16 = (np.abs(b).max(axis=-1) / np.float32(127)).astype(np.float16)
    d = d16.astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    q = np.clip(np.round(b * inv[..., None]), -127, 127).astype(np.int8)
    return QuantizedWeight(q.reshape(w.shape), d16, None, "q8", block)


def quantize_q4(w: np.ndarray) -> QuantizedWeight:
    """Float [..., N, K] -> "q4" blocks of 32, as ggml's `quantize_row_q4_1_ref`:
    d = (max - min) / 15 and min stored as f16, nib = round((w - min) / d) in [0, 15]
    (with the stored d and min).

    Raises:
      ValueError: K is not a multiple of 32.
    """
    b = _blocks(np.asarray(w, np.float32), Q4_BLOCK)
    lo, hi = b.min(axis=-1), b.max(axis=-1)
    d16, lo16 = ((hi - lo) / np.float32(15)).astype(np.float16), lo.astype(np.float16)
    d, lo = d16.astype(np.float32), lo16.astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    nib = np.clip(np.round((b - lo[..., None]) * inv[..., None]), 0, 15).astype(np.uint8)
    packed = nib[..., :16] | (nib[..., 16:] << 4)
    *lead, n, k = w.shape
    return QuantizedWeight(packed.reshape(*lead, n, k // 2), d16, lo16, "q4", Q4_BLOCK)


def dequantize(qw: QuantizedWeight, dtype=np.float32) -> np.ndarray:
    """The NumPy reference dequantization: [..., N, K] in `dtype` (float64 for tests).
    In float32 it is bit-identical to ggml's (and gguf-py's) dequantization of the same blocks."""
    q, scale = np.asarray(qw.q), np.asarray(qw.scale).astype(np.float32).astype(dtype)
    *lead, n, _ = q.shape
    if qw.kind == "q8":
        b = q.reshape(*lead, n, -1, qw.block).astype(dtype)
        return (b * scale[..., None]).reshape(qw.shape)
    pb = q.reshape(*lead, n, -1, 16)
    nib = np.concatenate([pb & 15, pb >> 4], axis=-1).astype(dtype)
    mn = np.asarray(qw.min).astype(np.float32).astype(dtype)
    return (nib * scale[..., None] + mn[..., None]).reshape(qw.shape)


def resolve_scheme(quantization: str, *, kept_kinds: set[str], source: str) -> str:
    """Check `quantization` against a checkpoint and say what float leaves become.

    Args:
      quantization: one of SCHEMES.
      kept_kinds: kinds of the checkpoint's own quantized matrices ({"q4", "q8"}, empty
        for an HF / F32 / F16 / BF16 file).
      source: the checkpoint, named in errors.
    Returns:
      "keep" (auto: every leaf stays as the checkpoint has it), "none" (quantized leaves
      are dequantized: full precision), "int8" (per-channel q8), "q8_0" or "q4".
    Raises:
      ValueError: an unknown scheme, or "q4" on a quantized file with no 4-bit tensors
        (a quantized file is never requantized to fewer bits).
    """
    if quantization not in SCHEMES:
        raise ValueError(f"quantization={quantization!r} must be one of {SCHEMES}")
    if quantization == "q4" and kept_kinds and "q4" not in kept_kinds:
        raise ValueError(f"quantization='q4' on {source}: the file has no 4-bit tensors "
                         f"(its quantized tensors are {sorted(kept_kinds)}); a quantized file is "
                         "never requantized to fewer bits")
    return "keep" if quantization == "auto" else quantization


def quantize_leaf(w: np.ndarray, scheme: str, *, key: str) -> Any:
    """One float canonical leaf under `scheme` ("none" | "int8" | "q8_0" | "q4"): a
    QuantizedWeight stored [N, K], or the leaf unchanged (norms, biases, "none").
    Layer matrices are [.., K, N] (transposed here); "embed" is [V, E] = [N, K] and
    "lm_head" [E, V]. Under "q4" the embedding and LM head get Q8_0 blocks, as in
    llama.cpp's Q4 files (the head is the most sensitive matrix)."""
    if scheme in ("keep", "none") or (key not in LINEAR_KEYS and key not in TOP_KEYS) \
            or is_quantized(w):
        return w
    a = np.asarray(w, np.float32)
    nk = a if key == "embed" else np.swapaxes(a, -1, -2)
    if scheme == "int8":
        return quantize_q8(nk, block=nk.shape[-1])
    if scheme == "q8_0" or key in TOP_KEYS:
        return quantize_q8(nk)
    return quantize_q4(nk)


def quantize_like(w: Any, like: QuantizedWeight, *, key: str) -> QuantizedWeight:
    """A float canonical leaf quantized to the format of `like` (update_params: a float
    trainer's weights into a quantized engine)."""
    if is_quantized(w):
        return w
    a = np.asarray(w, np.float32)
    nk = a if key == "embed" else np.swapaxes(a, -1, -2)
    return quantize_q4(nk) if like.kind == "q4" else quantize_q8(nk, block=like.block)


def tree_kinds(tree: Mapping[str, Any]) -> set[str]:
    """Kinds of the quantized leaves of a canonical tree."""
    leaves = [*tree.values(), *dict(tree.get("layers", {})).values()]
    return {v.kind for v in leaves if is_quantized(v)}


def dequantize_leaf(w: QuantizedWeight, *, key: str) -> np.ndarray:
    """A quantized canonical leaf back to its float canonical layout (f32): layer
    matrices and the LM head [.., K, N], the embedding [V, E] (quantization="none" on a
    quantized checkpoint's tree)."""
    a = dequantize(w)
    return a if key == "embed" else np.ascontiguousarray(np.swapaxes(a, -1, -2))


def engine_scheme(quantization: str, tree: Any, *, tensor_parallel_size: int) -> str:
    """The scheme the engine applies to `tree` (`resolve_scheme` with the tree's own
    quantized kinds), checked against tensor parallelism.

    Raises:
      ValueError: as `resolve_scheme`; or quantized weights with tensor_parallel_size > 1
        (not split yet: row-parallel shards would have to start on block boundaries),
        naming the block size and the split.
    """
    kinds = tree_kinds(tree) if isinstance(tree, Mapping) else set()
    scheme = resolve_scheme(quantization, kept_kinds=kinds, source="the model's weights")
    if tensor_parallel_size > 1 and (scheme not in ("keep", "none") or
                                     (scheme == "keep" and kinds)):
        raise ValueError(
            f"quantization={quantization!r} with tensor_parallel_size={tensor_parallel_size}: "
            f"quantized weights are not split across devices (each device's share of K "
            f"would have to hold whole {Q4_BLOCK}-element blocks, K / {tensor_parallel_size} "
            f"per device); use quantization='none' with tensor parallelism")
    return scheme


def abstract_quantized(shape: tuple[int, ...], scheme: str, *, key: str) -> QuantizedWeight:
    """A QuantizedWeight of zero-stride NumPy blocks for a canonical leaf of `shape` under
    `scheme` (the format `quantize_leaf` would give it), owning no memory: for
    deviceless compiles (`jaxserve.gpu.deviceless.abstract_params`)."""
    *lead, a, b = shape
    n, k = (a, b) if key == "embed" else (b, a)
    q8 = scheme != "q4" or key in TOP_KEYS
    block = k if scheme == "int8" else Q8_0_BLOCK if q8 else Q4_BLOCK

    def zeros(dt, *s):
        return np.broadcast_to(np.zeros((), dt), (*lead, n, *s))

    scale = zeros(np.float16, k // block)
    if q8:
        return QuantizedWeight(zeros(np.int8, k), scale, None, "q8", block)
    return QuantizedWeight(zeros(np.uint8, k // 2), scale, zeros(np.float16, k // block), "q4",
                           block)
