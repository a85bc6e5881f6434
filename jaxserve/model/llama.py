"""Flax NNX Llama-family decoder over a flat, ragged token axis.

The decoder follows Touvron et al. 2023 (RMSNorm, RoPE, SwiGLU) with
grouped-query attention (Ainslie et al. 2023) and Llama 3.1's band-wise RoPE
scaling. The same module runs Llama 2/3, SmolLM, Mistral (Jiang et al. 2023,
without its sliding window), Qwen2/Qwen2.5 (`cfg.attention_bias`: q/k/v biases)
and Qwen3 (`cfg.qk_norm`: per-head RMSNorm of q and k over head_dim, before
RoPE), as HF transformers' Qwen2Attention / Qwen3Attention do; sliding-window
layers (`cfg.layer_windows`) pass their window to the attention as data, and Gemma 3
runs its own block (`jaxserve.model.gemma3`). The paged KV cache (`[L, N, B, K, D]` for K and V) rides in the
layer loop's carry and is updated in place when the caller donates it (see
BUILD_NOTES.md for why: passing it as scan xs/ys copies it every step).

The canonical parameter tree is the state of the NNX module `Llama`
(HF weights transposed to [in, out], layers stacked on a leading [L] axis):
  embed [V,E]; layers/{attn_norm [L,E], wq [L,E,H*D], wk [L,E,K*D],
  wv [L,E,K*D], wo [L,H*D,E], mlp_norm [L,E], w_gate [L,E,F], w_up [L,E,F],
  w_down [L,F,E]}; final_norm [E]; lm_head [E,V] (absent when tied).
Optional layer leaves, present only for the families that have them:
  bq [L,H*D], bk [L,K*D], bv [L,K*D] (cfg.attention_bias); q_norm [L,D], k_norm [L,D]
  (cfg.qk_norm); post_attn_norm [L,E], post_mlp_norm [L,E] (cfg.sandwich_norms).
Loaders and the params cache produce it as NumPy; `prepare_params` is the one
transform into the engine layout (dtype, unstacked layers, optionally fused
projections; sharded placement with `place`). The forward functions are pure functions of either layout: with
stacked layers they run under `jax.lax.scan` (compile time flat in depth),
with unstacked ones as an unrolled loop.
"""

from __future__ import annotations

import functools
import math
import sys
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.attention.common import NO_WINDOW, AttentionBackend, MdT
from jaxserve.model import fused, gemma3
from jaxserve.model.linear import embed_rows, head_matrix_product, linear
from jaxserve.model.lora import project, project_many
from jaxserve.model.ops import apply_rope, rms_norm  # noqa: F401 - re-exported
from jaxserve.model.params import param_shapes  # noqa: F401 - re-exported
from jaxserve.model.quant import QuantizedWeight, engine_scheme, quantize_leaf

# One layer's weights, and a parameter tree: the canonical one (layers stacked on [L]) or
# the engine layout (`prepare_params`: cast, and with unroll_layers a list of L layer dicts).
LayerParams = dict[str, jax.Array]
Params = dict[str, "jax.Array | LayerParams | list[LayerParams]"]


def validate_params(cfg: ModelConfig, params: Mapping[str, object]) -> None:
    """Check a canonical tree against `param_shapes(cfg)`.

    Raises:
      ValueError: naming the path of the first missing or extra key, a leaf whose
        shape differs from the expected one, or a leaf whose dtype is not floating.
    """
    def walk(want, got, prefix):
        if not isinstance(got, Mapping) or set(want) != set(got):
            keys = sorted(got) if isinstance(got, Mapping) else type(got).__name__
            raise ValueError(f"parameter tree at {prefix or '/'}: keys {keys} != expected "
                             f"{sorted(want)}")
        for k, shape in want.items():
            path, leaf = f"{prefix}/{k}", got[k]
            if isinstance(shape, dict):
                walk(shape, leaf, path)
            elif isinstance(leaf, QuantizedWeight):  # stored [.., N, K]; canonical [.., K, N]
                *lead, n, kk = leaf.shape
                got_shape = (*lead, n, kk) if k == "embed" else (*lead, kk, n)
                if got_shape != shape:
                    raise ValueError(f"quantized parameter {path} has shape {got_shape}, "
                                     f"expected {shape}")
            elif tuple(getattr(leaf, "shape", ())) != shape:
                raise ValueError(f"parameter {path} has shape {tuple(getattr(leaf, 'shape', ()))}, "
                                 f"expected {shape}")
            elif not jnp.issubdtype(leaf.dtype, jnp.floating):
                raise ValueError(f"parameter {path} has dtype {leaf.dtype}, expected a floating "
                                 f"dtype (cast to ModelConfig.dtype={cfg.dtype!r})")

    walk(param_shapes(cfg), params, "")


def _cast(a: object, dt: np.dtype) -> object:
    """a in dtype dt: NumPy stays on the host (no copy when it already has dt); a jax
    leaf is always copied on its device, so the engine never shares a buffer with its
    caller (a trainer that donates its params must not delete the engine's weights).
    A QuantizedWeight keeps its integer blocks and f32 scales (jax fields copied)."""
    if isinstance(a, QuantizedWeight):
        return a.map(lambda f: jnp.array(f, copy=True) if isinstance(f, jax.Array) else f)
    if isinstance(a, jax.Array):
        return jnp.array(a, dtype=dt, copy=True)
    return np.asarray(a).astype(dt, copy=False)


def cast_params(params: Mapping[str, object], dtype: str) -> dict:
    """Every leaf of a (nested dict) tree in `dtype` ("float32" | "bfloat16"), same kind of array.

    Raises:
      ValueError: dtype is not "float32" or "bfloat16".
    """
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype={dtype!r} must be 'float32' or 'bfloat16'")
    dt = jnp.dtype(dtype)  # bfloat16 is ml_dtypes' NumPy type
    return {k: cast_params(v, dtype) if isinstance(v, Mapping) else _cast(v, dt)
            for k, v in params.items()}


def _quantize(key: str, leaf: object, scheme: str, like: object) -> object:
    """One canonical leaf under the engine's scheme; with `like` (the live engine's leaf,
    update_params) a float leaf takes the live leaf's quantized format."""
    if isinstance(like, QuantizedWeight) and not isinstance(leaf, QuantizedWeight):
        from jaxserve.model.quant import quantize_like

        return quantize_like(_host(leaf), like, key=key)
    if isinstance(leaf, QuantizedWeight):
        if scheme == "none":  # full precision asked of a quantized checkpoint
            from jaxserve.model.quant import dequantize_leaf

            return dequantize_leaf(leaf, key=key)
        return leaf
    if scheme in ("keep", "none"):
        return leaf
    q = quantize_leaf(_host(leaf), scheme, key=key)
    return q if isinstance(q, QuantizedWeight) else leaf


def _host(a: object) -> np.ndarray:
    """A float leaf as f32 NumPy (jax leaves are fetched: quantization runs at load)."""
    return np.asarray(jax.device_get(a) if isinstance(a, jax.Array) else a, np.float32)


def canonical_params(params: "Llama | nnx.State | Mapping[str, object]") -> dict:
    """The canonical tree as nested dicts: of a `Llama` module (split once), its state, or a tree."""
    nnx = sys.modules.get("flax.nnx")  # an NNX object implies flax.nnx is imported
    if nnx is None:
        return dict(params)
    if isinstance(params, nnx.Module):
        _, params = nnx.split(params)
    if isinstance(params, nnx.State):
        return nnx.to_pure_dict(params)
    return dict(params)


def fuse_projections(cfg: ModelConfig, lp: Mapping[str, object]) -> dict[str, object]:
    """One layer's (or the stacked layers') weights with wq|wk|wv -> wqkv and
    w_gate|w_up -> w_gate_up (bq|bk|bv -> bqkv with cfg.attention_bias): four matmuls a
    layer instead of seven (`jaxserve.model.fused`, float or block-quantized leaves)."""
    return fused.fuse_projections(lp, attention_bias=cfg.attention_bias)


def prepare_params(cfg: ModelConfig, params: "Llama | nnx.State | Mapping[str, object]", *,
                   unroll_layers: bool, fuse: bool | None = False,
                   place: Callable[[dict], Params] | None = None,
                   quantization: str = "auto", tensor_parallel_size: int = 1,
                   like: Params | None = None) -> Params:
    """The one transform from the canonical tree to the engine layout, on the device.

    Validates (`validate_params`), casts every leaf to cfg.dtype, with `fuse`
    concatenates the q/k/v and gate/up projections (`fuse_projections`) and, with
    `unroll_layers`, splits the stacked layers into a list of L per-layer dicts:
    `run_layers` then unrolls the layers and every matmul reads its own weight
    buffer, instead of the scan's per-layer dynamic-slice copy (notes/perf.md).
    Host NumPy leaves are cast and split as host views where possible and handed
    to `place`; device leaves are sliced, cast and copied on the device. With the
    default `place` (one `jax.device_put`) an aligned NumPy leaf on CPU is used in
    place rather than copied; the runner's `TensorParallel.place_params` copies
    every NumPy leaf into a private buffer first (unless the tree was handed over
    as `jaxserve.distributed.tensor_parallel.OwnedHostParams`), so the engine shares no buffer with
    its caller's arrays.

    Args:
      cfg: the model config (shapes and dtype).
      params: a `Llama` module, its `nnx.State`, or the canonical tree (NumPy or jax).
      unroll_layers: per-layer weight buffers (True) or the stacked [L] leaves.
      fuse: fused q/k/v and gate/up (`jaxserve.model.fused`); None: when the layers end
        up block-quantized in one format (`fused.fusable`). With `like`, its layout.
      place: puts the host-layout tree on the devices (default one `jax.device_put`);
        tensor parallelism passes `jaxserve.distributed.tensor_parallel.TensorParallel.place_params`,
        which places each leaf shard by shard with its sharding.
      quantization: `EngineConfig.quantization` ("auto" | "none" | "int8" | "q8_0" | "q4",
        resolved against the tree by `jaxserve.model.quant.engine_scheme`): what float
        matrices become (`quant.quantize_leaf`); `QuantizedWeight` leaves (a GGUF file's
        own blocks) are kept as they are, except under "none", which dequantizes them.
      tensor_parallel_size: quantized weights are refused with more than one device. Quantized leaves stay [N, K]
        blocks on the device; the forward dequantizes them on the fly (`model.linear`).
      like: the live engine tree (update_params): a float leaf whose live leaf is
        quantized is quantized to that leaf's format.

    Returns:
      The engine-layout tree of device arrays in cfg.dtype.

    Raises:
      ValueError: a missing, extra, mis-shaped or non-floating leaf (naming its path),
        or fuse=True with tensor parallelism (the fused layout has no sharding specs) or
        the Gemma 3 block; a bad quantization (`quant.engine_scheme`); fuse=True over
        parts of different quantized formats.
    """
    if fuse and cfg.sandwich_norms:
        raise ValueError("prepare_params: fuse=True is not implemented for the Gemma 3 block")
    if fuse and tensor_parallel_size > 1:
        raise ValueError("prepare_params: fuse=True has no sharded layout; use fuse=False "
                         f"with tensor_parallel_size={tensor_parallel_size}")
    tree = canonical_params(params)
    validate_params(cfg, tree)
    quantization = engine_scheme(quantization, tree, tensor_parallel_size=tensor_parallel_size)
    dt = jnp.dtype(cfg.dtype)
    like_top = like or {}
    like_l = (like or {}).get("layers")
    like_l = like_l[0] if isinstance(like_l, (list, tuple)) else (like_l or {})
    if like is not None:  # update_params: the live layout, each part like its fused leaf
        fuse, like_l = fused.is_fused(like_l), fused.unfused_like(like_l)
    tree = {k: _quantize(k, v, quantization, like_top.get(k)) for k, v in tree.items()
            if k != "layers"} | {"layers": {k: _quantize(k, v, quantization, like_l.get(k))
                                            for k, v in tree["layers"].items()}}
    if fuse is None:
        fuse = fused.fusable(tree["layers"]) and not cfg.sandwich_norms
    out = {k: _cast(v, dt) for k, v in tree.items() if k != "layers"}
    layers = tree["layers"]
    layout = functools.partial(fuse_projections, cfg) if fuse else dict

    def layer(w, i):
        return w.layer(i) if isinstance(w, QuantizedWeight) else w[i]

    if unroll_layers:
        out["layers"] = [layout({k: _cast(layer(w, i), dt) for k, w in layers.items()})
                         for i in range(cfg.num_hidden_layers)]
    else:
        out["layers"] = layout({k: _cast(w, dt) for k, w in layers.items()})
    return (place or jax.device_put)(out)


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


# An attention callback: (q [T,H,D], k [T,K,D], v [T,K,D], carry, layer, window) ->
# (out [T,H,D], carry); window: i32[] keys a query sees (sliding window) or None.
AttnFn = Callable[..., tuple[jax.Array, Any]]


def layer_window(cfg: ModelConfig, layer_index: Any) -> jax.Array | None:
    """i32[] the sliding window of layer `layer_index` (an int or a traced i32; global
    layers get NO_WINDOW), or None when no layer of the model slides (the Llama
    programs stay as they were). Data, not a static: one layer program serves all."""
    if not cfg.has_sliding_layers:
        return None
    table = np.array([w or NO_WINDOW for w in cfg.layer_windows], np.int32)
    return jnp.asarray(table)[layer_index]


def layer_inv_freq(cfg: ModelConfig, inv_freq: jax.Array, layer_index: Any) -> jax.Array:
    """The RoPE table of layer `layer_index`: Gemma 3's sliding layers rotate with
    rope_local_base_freq, every other layer with `inv_freq` (rope_theta's)."""
    if cfg.rope_local_base_freq is None or not cfg.has_sliding_layers:
        return inv_freq
    local = jnp.asarray(rope_inv_freq(cfg.replace(rope_theta=cfg.rope_local_base_freq,
                                                  rope_scaling=None)))
    is_local = np.array([w is not None for w in cfg.layer_windows])
    return jnp.where(jnp.asarray(is_local)[layer_index], local, inv_freq)


def decoder_layer(cfg: ModelConfig, x: jax.Array, lp: dict[str, jax.Array], positions: jax.Array,
                  inv_freq: jax.Array, attn_fn: AttnFn, attn_carry: Any, layer: jax.Array, *,
                  layer_index: Any = None, lora_slots: jax.Array | None = None):
    """One pre-norm Llama block on x [T, E]; returns (x [T, E], attn_carry).

    `lora_slots` i32[T] (issue 27): each token's LoRA slot (0 = none); the projections
    then add their adapter's delta when `lp` carries a pool (`jaxserve.model.lora`).

    With cfg.attention_bias the q/k/v projections add their biases (Qwen2); with
    cfg.qk_norm q and k are RMS-normed per head over D before RoPE (Qwen3). `layer`
    indexes a stacked cache (None: per-layer caches); `layer_index` (default `layer`)
    is the layer's place in the model, which picks its sliding window and RoPE table.
    With cfg.sandwich_norms the block is Gemma 3's (`jaxserve.model.gemma3`).
    """
    index = layer if layer_index is None else layer_index
    window = layer_window(cfg, index)
    if cfg.sandwich_norms:
        return gemma3.decoder_layer(cfg, x, lp, positions, layer_inv_freq(cfg, inv_freq, index),
                                    attn_fn, attn_carry, layer, window=window,
                                    lora_slots=lora_slots)
    T = x.shape[0]
    H, K, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    if "wqkv" in lp:  # engine layout (`fuse_projections`): one matmul, then split
        qkv = linear(h, lp["wqkv"])
        if cfg.attention_bias:
            qkv = qkv + lp["bqkv"]
        q, k, v = jnp.split(qkv, [H * D, (H + K) * D], axis=-1)
    else:  # the canonical keys: the reference path and the default engine layout
        q, k, v = project_many(h, lp, ("wq", "wk", "wv"), lora_slots)
        if cfg.attention_bias:
            q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q, k, v = q.reshape(T, H, D), k.reshape(T, K, D), v.reshape(T, K, D)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq)
    o, attn_carry = attn_fn(q, k, v, attn_carry, layer, window)  # [T, H, D]
    x = x + project(o.reshape(T, H * D), lp, "wo", lora_slots)
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    if "w_gate_up" in lp:
        gate, up = jnp.split(linear(h, lp["w_gate_up"]), 2, axis=-1)
    else:
        gate, up = project_many(h, lp, ("w_gate", "w_up"), lora_slots)
    x = x + project(jax.nn.silu(gate) * up, lp, "w_down", lora_slots)  # (Gemma: gemma3.py)
    return x, attn_carry


def run_layers(cfg: ModelConfig, params: Params, input_ids: jax.Array, positions: jax.Array,
               attn_fn: AttnFn, attn_carry: Any, lora_slots: jax.Array | None = None
               ) -> tuple[jax.Array, Any]:
    """Embed input_ids i32[T] and run all layers under a scan (or unrolled, when
    params["layers"] is a list of per-layer dicts, see `prepare_params`).

    Returns the final-normed hidden states [T, E] and the attention carry
    (the KV cache for the paged path).
    """
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    x = embed_tokens(cfg, params["embed"], input_ids)  # [T, E]
    if isinstance(params["layers"], (list, tuple)):
        # Unstacked weights (see `prepare_params`): a Python loop, each matmul reading its
        # own weight buffer. Under the scan XLA:CPU copies every layer's weight slice out
        # of the stacked array before its dot (the whole model, ~540 MB, every step).
        ac = attn_carry
        for i, lp in enumerate(params["layers"]):
            x, ac = decoder_layer(cfg, x, lp, positions, inv_freq, attn_fn, ac, jnp.int32(i),
                                  lora_slots=lora_slots)
        return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), ac
    layer_ids = jnp.arange(cfg.num_hidden_layers, dtype=jnp.int32)

    def body(carry, xs):
        x, ac = carry
        lp, layer = xs
        x, ac = decoder_layer(cfg, x, lp, positions, inv_freq, attn_fn, ac, layer,
                              lora_slots=lora_slots)
        return (x, ac), None

    (x, attn_carry), _ = jax.lax.scan(body, (x, attn_carry), (params["layers"], layer_ids))
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), attn_carry


def embed_tokens(cfg: ModelConfig, embed: jax.Array, input_ids: jax.Array) -> jax.Array:
    """embed [V, E] gathered at input_ids i32[T] -> [T, E]; Gemma scales by sqrt(E) in
    the embedding's dtype (as transformers' Gemma3TextScaledWordEmbedding)."""
    x = embed_rows(embed, input_ids)
    if cfg.scale_embeddings:
        x = x * jnp.asarray(cfg.hidden_size ** 0.5, x.dtype)
    return x


def compute_logits(cfg: ModelConfig, params: Params, hidden: jax.Array) -> jax.Array:
    """hidden [S, E] -> f32[S, V] through `model.linear.head_matrix_product` (tied
    embeddings reuse embed [V, E]; on CPU a tied fp32 or a quantized head at few rows runs a
    native kernel with no one-row penalty); with
    cfg.final_logit_softcapping c, c * tanh(logits / c) (Gemma 2)."""
    w = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    if not isinstance(w, QuantizedWeight) and not cfg.tie_word_embeddings and hidden.shape[0] == 1:
        # XLA:CPU lowers a one-row dot to a single-threaded loop (notes/perf.md): pad to two.
        logits = head_matrix_product(jnp.pad(hidden, ((0, 1), (0, 0))), w, tied=False)[:1]
    else:
        logits = head_matrix_product(hidden, w, tied=cfg.tie_word_embeddings)
    logits = logits.astype(jnp.float32)
    cap = cfg.final_logit_softcapping
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def dense_causal_attn(cfg: ModelConfig) -> AttnFn:
    """Plain causal GQA over one contiguous sequence (tests and the reference path), with
    the layer's sliding window when it has one."""
    scale = cfg.attn_scale
    rep = cfg.num_queries_per_kv

    def fn(q, k, v, carry, layer, window=None):
        T = q.shape[0]
        kr = jnp.repeat(k, rep, axis=1)  # [T, H, D]
        vr = jnp.repeat(v, rep, axis=1)
        s = jnp.einsum("thd,shd->hts", q.astype(jnp.float32), kr.astype(jnp.float32)) * scale
        mask = jnp.tril(jnp.ones((T, T), dtype=bool))
        if window is not None:
            pos = jnp.arange(T)
            mask &= pos[None, :] > pos[:, None] - window
        s = jnp.where(mask[None], s, -1e30)
        p = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("hts,shd->thd", p, vr.astype(jnp.float32))
        return o.astype(q.dtype), carry

    return fn


def paged_attn(cfg: ModelConfig, md: MdT, backend: AttentionBackend[MdT]) -> AttnFn:
    """Write K/V through the backend, then ragged paged attention.

    The carry is (k_cache, v_cache), each [L, N, B, K, D]; `window` (i32[] or None) is
    the layer's sliding window, handed to the backend as data.
    """
    scale = cfg.attn_scale

    def fn(q, k, v, carry, layer, window=None):
        k_cache, v_cache = backend.write_kv(*carry, k, v, md, layer=layer)
        kw = {} if window is None else {"sliding_window": window}
        o = backend.attention(q, k_cache, v_cache, md, layer=layer, sm_scale=scale, **kw)
        return o, (k_cache, v_cache)

    return fn


def forward_paged(cfg: ModelConfig, params: Params, input_ids: jax.Array,
                  positions: jax.Array, kv_cache: tuple[jax.Array, jax.Array], attn_md: MdT,
                  logits_indices: jax.Array, *, backend: AttentionBackend[MdT]
                  ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """The engine's forward over a ragged, bucket-padded batch.

    Args:
      params: the engine layout from `prepare_params`.
      input_ids: i32[T_pad]; positions: i32[T_pad].
      kv_cache: (k_cache, v_cache), each [L, N, B, K, D]; donate it.
      attn_md: `backend.prepare(common)` of this batch (device arrays).
      logits_indices: i32[S_pad], the flat token index whose logits are wanted.
      backend: the attention backend the runner chose.
    Returns:
      (logits f32[S_pad, V], kv_cache).
    """
    hidden, kv_cache = run_layers(cfg, params, input_ids, positions,
                                  paged_attn(cfg, attn_md, backend), kv_cache)
    return compute_logits(cfg, params, hidden[logits_indices]), kv_cache


def reference_logits(cfg: ModelConfig, params: Params, input_ids: np.ndarray) -> np.ndarray:
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


def __getattr__(name: str):
    """`Llama` (the NNX module) lives in `jaxserve.model.nnx`: importing flax costs
    ~1 s of a start-up that only needs the pure functions above (notes/params_startup.md)."""
    if name == "Llama":
        from jaxserve.model.nnx import Llama

        return Llama
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
