"""Flax NNX Llama (Llama 2 / Llama 3 / SmolLM) over a flat, ragged token axis.

The decoder follows Touvron et al. 2023 (RMSNorm, RoPE, SwiGLU) with
grouped-query attention (Ainslie et al. 2023) and Llama 3.1's band-wise RoPE
scaling. Layer weights are stacked on a leading [L] axis and the layers run
under `jax.lax.scan`, so compile time does not grow with depth. The paged KV
cache (`[L, N, B, K, D]` for K and V) rides in the scan carry and is updated
in place when the caller donates it (see BUILD_NOTES.md for why: passing it
as scan xs/ys copies it every step).

Parameter tree (HF weights transposed to [in, out]):
  embed [V,E]; layers/{attn_norm [L,E], wq [L,E,H*D], wk [L,E,K*D],
  wv [L,E,K*D], wo [L,H*D,E], mlp_norm [L,E], w_gate [L,E,F], w_up [L,E,F],
  w_down [L,F,E]}; final_norm [E]; lm_head [E,V] (absent when tied).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig

LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    """The expected shape of every leaf of the parameter tree for `cfg`."""
    L, E, F = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size
    H, K, D, V = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size
    shapes = {
        "embed": (V, E),
        "layers": {"attn_norm": (L, E), "wq": (L, E, H * D), "wk": (L, E, K * D),
                   "wv": (L, E, K * D), "wo": (L, H * D, E), "mlp_norm": (L, E),
                   "w_gate": (L, E, F), "w_up": (L, E, F), "w_down": (L, F, E)},
        "final_norm": (E,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (E, V)
    return shapes


def check_params(cfg: ModelConfig, params: dict[str, Any]) -> None:
    """Raise ValueError naming the first missing, extra or mis-shaped leaf."""
    want = param_shapes(cfg)

    def walk(w, p, prefix):
        if set(w) != set(p):
            raise ValueError(f"parameter tree at {prefix or '/'}: keys {sorted(p)} != expected {sorted(w)}")
        for k, shape in w.items():
            if isinstance(shape, dict):
                walk(shape, p[k], f"{prefix}/{k}")
            elif tuple(p[k].shape) != shape:
                raise ValueError(f"parameter {prefix}/{k} has shape {tuple(p[k].shape)}, "
                                 f"expected {shape}")

    walk(want, params, "")


# ---------------------------------------------------------------- RoPE
def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """f32[D/2] inverse frequencies, with Llama 3.1 scaling when configured.

    Computed in float32 the way HF transformers does, so positions rotate
    bit-compatibly with the golden outputs.
    """
    D = cfg.head_dim
    exponent = np.arange(0, D, 2, dtype=np.int64).astype(np.float32) / np.float32(D)
    inv_freq = (np.float32(1.0) / (np.float32(cfg.rope_theta) ** exponent)).astype(np.float32)
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq
    old = rs.original_max_position_embeddings
    low_wavelen = old / rs.low_freq_factor
    high_wavelen = old / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate x [T, N, D] by positions i32[T] (HF rotate_half layout)."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos = jnp.cos(freqs)[:, None, :]
    sin = jnp.sin(freqs)[:, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm (Zhang & Sennrich 2019) in fp32, cast back before the weight as HF does."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


# An attention callback: (q [T,H,D], k [T,K,D], v [T,K,D], carry, layer) -> (out [T,H,D], carry)
AttnFn = Callable[[jax.Array, jax.Array, jax.Array, Any, jax.Array], tuple[jax.Array, Any]]


def decoder_layer(cfg: ModelConfig, x: jax.Array, lp: dict[str, jax.Array], positions: jax.Array,
                  inv_freq: jax.Array, attn_fn: AttnFn, attn_carry: Any, layer: jax.Array):
    """One pre-norm Llama block on x [T, E]; returns (x [T, E], attn_carry)."""
    T = x.shape[0]
    H, K, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    q = (h @ lp["wq"]).reshape(T, H, D)
    k = (h @ lp["wk"]).reshape(T, K, D)
    v = (h @ lp["wv"]).reshape(T, K, D)
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq)
    o, attn_carry = attn_fn(q, k, v, attn_carry, layer)  # [T, H, D]
    x = x + o.reshape(T, H * D) @ lp["wo"]
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    x = x + (jax.nn.silu(h @ lp["w_gate"]) * (h @ lp["w_up"])) @ lp["w_down"]
    return x, attn_carry


def unstack_layers(params: dict[str, Any]) -> dict[str, Any]:
    """The parameter tree with params["layers"] as a list of L per-layer dicts.

    Same leaves, split on the [L] axis into separate arrays: `run_layers` then
    unrolls the layers and every matmul reads its weight in place, instead of
    the scan's per-layer dynamic-slice copy (measured in notes/perf.md).
    """
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return params
    n = next(iter(layers.values())).shape[0]
    return dict(params, layers=[{k: w[i] for k, w in layers.items()} for i in range(n)])


def run_layers(cfg: ModelConfig, params: dict[str, Any], input_ids: jax.Array, positions: jax.Array,
               attn_fn: AttnFn, attn_carry: Any) -> tuple[jax.Array, Any]:
    """Embed input_ids i32[T] and run all layers under a scan (or unrolled, when
    params["layers"] is a list of per-layer dicts, see `unstack_layers`).

    Returns the final-normed hidden states [T, E] and the attention carry
    (the KV cache for the paged path).
    """
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    x = params["embed"][input_ids]  # [T, E]
    if isinstance(params["layers"], (list, tuple)):
        # Unstacked weights (see `unstack_layers`): a Python loop, each matmul reading its
        # own weight buffer. Under the scan XLA:CPU copies every layer's weight slice out
        # of the stacked array before its dot (the whole model, ~540 MB, every step).
        ac = attn_carry
        for i, lp in enumerate(params["layers"]):
            x, ac = decoder_layer(cfg, x, lp, positions, inv_freq, attn_fn, ac, jnp.int32(i))
        return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), ac
    layer_ids = jnp.arange(cfg.num_hidden_layers, dtype=jnp.int32)

    def body(carry, xs):
        x, ac = carry
        lp, layer = xs
        x, ac = decoder_layer(cfg, x, lp, positions, inv_freq, attn_fn, ac, layer)
        return (x, ac), None

    (x, attn_carry), _ = jax.lax.scan(body, (x, attn_carry), (params["layers"], layer_ids))
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), attn_carry


def compute_logits(cfg: ModelConfig, params: dict[str, Any], hidden: jax.Array) -> jax.Array:
    """hidden [S, E] -> f32[S, V] (tied embeddings reuse embed.T)."""
    w = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    s = hidden.shape[0]
    if s == 1:
        # XLA:CPU lowers a one-row dot to a single-threaded loop: 14 ms for the tied
        # [49152, 576] head vs 6 ms for two rows (notes/perf.md). Pad to two rows.
        return (jnp.pad(hidden, ((0, 1), (0, 0))) @ w)[:1].astype(jnp.float32)
    return (hidden @ w).astype(jnp.float32)


def dense_causal_attn(cfg: ModelConfig) -> AttnFn:
    """Plain causal GQA over one contiguous sequence (tests and the reference path)."""
    scale = cfg.head_dim ** -0.5
    rep = cfg.num_queries_per_kv

    def fn(q, k, v, carry, layer):
        T = q.shape[0]
        kr = jnp.repeat(k, rep, axis=1)  # [T, H, D]
        vr = jnp.repeat(v, rep, axis=1)
        s = jnp.einsum("thd,shd->hts", q.astype(jnp.float32), kr.astype(jnp.float32)) * scale
        mask = jnp.tril(jnp.ones((T, T), dtype=bool))
        s = jnp.where(mask[None], s, -1e30)
        p = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("hts,shd->thd", p, vr.astype(jnp.float32))
        return o.astype(q.dtype), carry

    return fn


def paged_attn(cfg: ModelConfig, md: Any, *, backend: str, interpret: bool = False) -> AttnFn:
    """Write K/V through md.slot_mapping, then ragged paged attention.

    The carry is (k_cache, v_cache), each [L, N, B, K, D].
    """
    from jaxserve.model import attention

    scale = cfg.head_dim ** -0.5

    def fn(q, k, v, carry, layer):
        k_cache, v_cache = carry
        k_cache, v_cache = attention.write_kv(k_cache, v_cache, k, v, md, layer=layer, backend=backend)
        o = attention.attention(q, k_cache, v_cache, md, layer=layer, sm_scale=scale,
                                backend=backend, interpret=interpret)
        return o, (k_cache, v_cache)

    return fn


def forward_paged(cfg: ModelConfig, params: dict[str, Any], input_ids: jax.Array,
                  positions: jax.Array, kv_cache: tuple[jax.Array, jax.Array], md: Any,
                  logits_indices: jax.Array, *, backend: str = "xla", interpret: bool = False):
    """The engine's forward over a ragged, bucket-padded batch.

    Args:
      input_ids: i32[T_pad]; positions: i32[T_pad].
      kv_cache: (k_cache, v_cache), each [L, N, B, K, D]; donate it.
      md: `jaxserve.model.attention.AttentionMetadata` for this batch.
      logits_indices: i32[S_pad], the flat token index whose logits are wanted.
    Returns:
      (logits f32[S_pad, V], kv_cache).
    """
    hidden, kv_cache = run_layers(cfg, params, input_ids, positions,
                                  paged_attn(cfg, md, backend=backend, interpret=interpret), kv_cache)
    return compute_logits(cfg, params, hidden[logits_indices]), kv_cache


def reference_logits(cfg: ModelConfig, params: dict[str, Any], input_ids: np.ndarray) -> np.ndarray:
    """Logits f32[T, V] of one sequence input_ids i32[T] with plain causal attention.

    A direct path with no paging or padding: the test oracle for the paged
    forward and the function checked against HF transformers' golden logits.
    """
    ids = jnp.asarray(np.asarray(input_ids, dtype=np.int32))
    pos = jnp.arange(ids.shape[0], dtype=jnp.int32)
    hidden, _ = _jit_reference(cfg, params, ids, pos)
    return np.asarray(compute_logits(cfg, params, hidden))


@functools.partial(jax.jit, static_argnums=0)
def _jit_reference(cfg, params, ids, pos):
    return run_layers(cfg, params, ids, pos, dense_causal_attn(cfg), None)


# ---------------------------------------------------------------- NNX module
class Llama(nnx.Module):
    """Llama decoder as an NNX module holding the stacked parameter tree.

    `Llama(cfg, rngs=nnx.Rngs(0))` initialises random weights (normal,
    std `init_std`); `Llama.from_params(cfg, tree)` wraps loaded weights.
    `nnx.split(model)` once gives (graphdef, state); the engine jits a pure
    function of the state (see `jaxserve.model_runner`).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, init_std: float = 0.02):
        dt = jnp.dtype(cfg.dtype)
        shapes = param_shapes(cfg)

        def init(shape, key_name):
            if key_name.endswith("norm"):
                return jnp.ones(shape, dt)
            return (init_std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dt)

        self.cfg = cfg
        self.embed = nnx.Param(init(shapes["embed"], "embed"))
        self.layers = nnx.Dict({k: nnx.Param(init(s, k)) for k, s in shapes["layers"].items()})
        self.final_norm = nnx.Param(init(shapes["final_norm"], "final_norm"))
        self.lm_head = None if cfg.tie_word_embeddings else nnx.Param(init(shapes["lm_head"], "lm_head"))

    @classmethod
    def from_params(cls, cfg: ModelConfig, params: dict[str, Any]) -> "Llama":
        """Wrap a loaded parameter tree (cast to cfg.dtype); ValueError on a shape mismatch."""
        check_params(cfg, params)
        model = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0)))
        dt = jnp.dtype(cfg.dtype)
        model.embed = nnx.Param(jnp.asarray(params["embed"], dt))
        model.layers = nnx.Dict({k: nnx.Param(jnp.asarray(params["layers"][k], dt)) for k in LAYER_KEYS})
        model.final_norm = nnx.Param(jnp.asarray(params["final_norm"], dt))
        model.lm_head = None if cfg.tie_word_embeddings else nnx.Param(jnp.asarray(params["lm_head"], dt))
        return model

    def param_tree(self) -> dict[str, Any]:
        """The plain parameter tree (arrays), as the pure functions above take it."""
        tree = {"embed": self.embed[...], "layers": {k: self.layers[k][...] for k in LAYER_KEYS},
                "final_norm": self.final_norm[...]}
        if self.lm_head is not None:
            tree["lm_head"] = self.lm_head[...]
        return tree

    def __call__(self, input_ids, positions, kv_cache, md, logits_indices, *, backend="xla",
                 interpret=False):
        return forward_paged(self.cfg, self.param_tree(), input_ids, positions, kv_cache, md,
                             logits_indices, backend=backend, interpret=interpret)
