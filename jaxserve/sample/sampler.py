"""Batched token sampling with per-request parameter arrays (runs inside the jitted step).

Every sampling parameter is a per-row array in `SamplingMetadata`, never a static
argument, so a new temperature or top-p never recompiles (DESIGN.md, C24). The
pytree structure is the same for every batch: rows that use no penalty still carry
a (filled with -1) token history.

Semantics follow vLLM (`vllm/v1/sample/sampler.py`):
  0. logit_bias (OpenAI): a per-row [S, 300] (id, bias) pair added to the logits
     (padding entries add 0 to id 0), so any bias is data and never recompiles;
  1. repetition penalty on prompt+output tokens, then frequency/presence penalties
     on output-token counts (CTRL, Keskar et al. 2019; OpenAI API);
  2. stop/EOS ids suppressed while a request has fewer than `min_tokens` outputs;
  2b. structured output: a per-row allowed-token bitmask i32[S, ceil(V/32)] (bit t % 32
     of word t // 32 = token t; -1 words allow everything) sets disallowed logits to
     -inf, under a `lax.cond` skipped when the whole batch is -1 (rows without a
     grammar); a [S, 0] bitmask means no mask at all. It comes after 0-2 only because
     -inf is a fixed point of bias, penalties and suppression (the same result as
     vLLM's masking before its sampler) and masking the raw input measured 1.5-2x
     slower at S=32 on XLA:CPU (notes/structured_output.md); it is before
     temperature/top-k/top-p/min-p and greedy, so every sampled id is allowed;
  3. greedy rows (temperature < 1e-5 or top_k == 1) take argmax, ties to the lowest id;
  4. sampled rows: divide by temperature, top-k, top-p (nucleus, Holtzman et al. 2020,
     computed on the top-k-renormalised distribution), min-p (Nguyen et al. 2024), then
     draw one token by inverse-CDF sampling with a per-row key.
Logprobs follow vLLM's `logprobs_mode`: "raw_logprobs" (default) is the model's raw
distribution (log_softmax of the unmodified logits; the grammar mask, like the
penalties, is processing and is not in it); "processed_logprobs" is the distribution
actually sampled from, after penalties, min_tokens suppression, the grammar mask,
temperature and top-k/top-p/min-p (greedy rows are neither temperature-scaled nor
top-k/top-p filtered), which RL importance ratios at temperature != 1 need; ids the
filters removed get -inf. Processed mode always builds the filtered [S, V] logits.

A row's random key is `fold_in(key(seed), output_pos)`: it depends only on the
request's (seed, output position), never on the row index, batch-mates, the bucket
or a preemption (C21).

Cost (CPU, see notes/sampler.md): a full per-row sort of V=49152 costs ~560 ms at
S=64, so top-k/top-p thresholds come from `lax.top_k` over a small window of the
largest logits, with an exact 32-step bisection over the float bit patterns for
rows whose nucleus (or k) does not fit in the window. Each stage runs under a
`lax.cond` that skips it when no row in the batch needs it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

# The host half (NumPy): limits, `SamplingMetadata`, `SamplingRow`, `make_sampling_metadata`.
from jaxserve.sample.metadata import (  # noqa: F401 - re-exported
    DEFAULT_TOP_WINDOW, LOGPROBS_MODES, MAX_EOS_TOKEN_IDS, SAMPLING_EPS, SUPPRESS_WIDTH,
    SamplingMetadata, SamplingRow, make_sampling_metadata)

# The metadata crosses into jitted programs: a pytree whose leaves are all its fields.
jax.tree_util.register_dataclass(SamplingMetadata)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    """Result of `sample` for S rows (padding rows included; the caller drops them)."""

    token_ids: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S]; raw-distribution logprob of token_ids
    top_ids: jax.Array  # i32[S, max_logprobs]; most likely ids, descending
    top_logprobs: jax.Array  # f32[S, max_logprobs]


def apply_bitmask(x: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Set to -inf the logits x (f32[S, V]) whose bit in bitmask (i32[S, ceil(V/32)]) is 0.

    Bit t % 32 of word t // 32 is token t (llguidance's and xgrammar's layout).
    """
    S, V = x.shape
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, W, 32]
    allowed = bits.reshape(S, -1)[:, :V] != 0
    return jnp.where(allowed, x, -jnp.inf)


def apply_penalties(x: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Apply vLLM's penalties to logits x: f32[S, V] -> f32[S, V].

    Repetition penalty (CTRL) on every token seen in prompt+output: positive logits are
    divided by it, negative ones multiplied. Then OpenAI-style frequency (times the
    output count) and presence (once if the count > 0) penalties, output tokens only.
    """
    S, V = x.shape
    hist = md.token_history  # [S, M]
    rows = jnp.broadcast_to(jnp.arange(S)[:, None], hist.shape)
    # Out-of-range ids (-1 padding) go to index V, which mode="drop" discards.
    idx = jnp.where((hist >= 0) & (hist < V), hist, V)
    is_out = jnp.arange(hist.shape[1])[None, :] >= md.prompt_lens[:, None]
    seen = jnp.zeros((S, V), jnp.bool_).at[rows, idx].set(True, mode="drop")
    counts = jnp.zeros((S, V), jnp.float32).at[rows, jnp.where(is_out, idx, V)].add(
        1.0, mode="drop")
    rp = md.repetition_penalty[:, None]
    x = jnp.where(seen, jnp.where(x > 0, x / rp, x * rp), x)
    x = x - md.frequency_penalty[:, None] * counts
    return x - md.presence_penalty[:, None] * (counts > 0).astype(x.dtype)


def _sortable(z: jax.Array) -> jax.Array:
    """Map f32 to u32 so that unsigned order equals float order (radix-sort flip)."""
    bits = jax.lax.bitcast_convert_type(z, jnp.uint32)
    neg = (bits >> 31) == 1
    return jnp.where(neg, ~bits, bits | jnp.uint32(0x80000000))


def _unsortable(u: jax.Array) -> jax.Array:
    """Inverse of `_sortable`."""
    pos = (u >> 31) == 1
    bits = jnp.where(pos, u & jnp.uint32(0x7FFFFFFF), ~u)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _bisect_max(pred, S: int) -> jax.Array:
    """Largest u32 t (per row) with pred(t) true, for pred monotone non-increasing, pred(0) true."""

    def body(_, carry):
        lo, hi = carry  # invariant: pred(lo), answer in [lo, hi]
        span = hi - lo
        mid = lo + (span >> 1) + (span & 1)
        ok = pred(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo = jnp.zeros((S,), jnp.uint32)
    hi = jnp.full((S,), 0xFFFFFFFF, jnp.uint32)
    lo, _ = jax.lax.fori_loop(0, 32, body, (lo, hi))
    return lo


def _bisect_threshold(z, k_eff, k_on, top_p, p_on):
    """Exact top-k then top-p logit threshold by bisection over float bit patterns. f32[S]."""
    S = z.shape[0]
    key = _sortable(z)  # [S, V]
    t_k = _bisect_max(lambda t: jnp.sum(key >= t[:, None], -1) >= k_eff, S)
    t_k = jnp.where(k_on, t_k, 0)
    e = jnp.where(key >= t_k[:, None], jnp.exp(z - jnp.max(z, -1, keepdims=True)), 0.0)
    mass = top_p * jnp.sum(e, -1)
    t_p = _bisect_max(lambda t: jnp.sum(jnp.where(key >= t[:, None], e, 0.0), -1) >= mass, S)
    t_p = jnp.where(p_on, t_p, 0)
    return _unsortable(jnp.maximum(t_k, t_p))


def _top_k_top_p(z, k_eff, k_on, top_p, p_on, window: int):
    """Mask z (f32[S, V], temperature-scaled) to the top-k, then top-p, set of each row."""
    S, V = z.shape
    W = min(window, V)
    vals, _ = jax.lax.top_k(z, W)  # [S, W] descending
    # Not vals[:, :1]: slicing top_k's output makes XLA:CPU lower top_k to a full sort
    # of [S, V] (measured 190 ms vs 5 ms at S=8, V=49152; notes/sampler.md).
    zmax = jnp.max(z, -1, keepdims=True)
    k_fits = k_eff <= W
    thr_k = jnp.take_along_axis(vals, jnp.clip(k_eff - 1, 0, W - 1)[:, None], -1)[:, 0]
    thr_k = jnp.where(k_on, thr_k, -jnp.inf)  # [S]
    # Nucleus over the top-k-renormalised distribution; Z needs the full row.
    Z = jnp.sum(jnp.where(z >= thr_k[:, None], jnp.exp(z - zmax), 0.0), -1, keepdims=True)
    pv = jnp.where(vals >= thr_k[:, None], jnp.exp(vals - zmax), 0.0) / Z  # [S, W]
    incl = jnp.cumsum(pv, -1)
    cut = jnp.sum((incl - pv) < top_p[:, None], -1)  # kept positions, >= 1
    thr_p = jnp.take_along_axis(vals, jnp.clip(cut - 1, 0, W - 1)[:, None], -1)[:, 0]
    thr_p = jnp.where(p_on, thr_p, -jnp.inf)
    # The window answer is exact unless k, or the nucleus, reaches past the window
    # (a nucleus cut by a top-k that fits is always inside the window).
    p_fits = (incl[:, -1] >= top_p) | (k_on & k_fits)
    ok = (~k_on | k_fits) & (~p_on | p_fits)
    thr = jnp.maximum(thr_k, thr_p)
    thr = jax.lax.cond(
        jnp.all(ok), lambda: thr,
        lambda: jnp.where(ok, thr, _bisect_threshold(z, k_eff, k_on, top_p, p_on)))
    return jnp.where(z >= thr[:, None], z, -jnp.inf)


def filter_logits(x: jax.Array, md: SamplingMetadata, greedy: jax.Array,
                  top_window: int = DEFAULT_TOP_WINDOW) -> jax.Array:
    """Temperature-scale x (f32[S, V]) and mask to -inf what top-k, top-p, min-p remove.

    Greedy rows (bool[S]) are left unscaled and unfiltered. Returns f32[S, V]; the
    finite entries of a row are exactly its allowed set.
    """
    S, V = x.shape
    z = x / jnp.where(greedy, 1.0, md.temperature)[:, None]
    k_eff = jnp.where((md.top_k <= 0) | (md.top_k >= V), V, md.top_k)
    k_on = (k_eff < V) & ~greedy
    p_on = (md.top_p < 1.0) & ~greedy
    z = jax.lax.cond(
        jnp.any(k_on | p_on),
        lambda: _top_k_top_p(z, k_eff, k_on, md.top_p, p_on, top_window), lambda: z)
    zmax = jnp.max(z, -1, keepdims=True)
    # min-p: keep p >= min_p * p_max  <=>  z - zmax >= log(min_p); log(0) = -inf keeps all.
    return jnp.where(z - zmax >= jnp.log(md.min_p)[:, None], z, -jnp.inf)


def _sample_random(z: jax.Array, md: SamplingMetadata):
    """Draw one token per row from z (f32[S, V], `filter_logits`' output). i32[S]."""
    S, V = z.shape
    zmax = jnp.max(z, -1, keepdims=True)

    def row_uniform(key_data, pos):
        key = jax.random.fold_in(jax.random.wrap_key_data(key_data, impl="threefry2x32"), pos)
        return jax.random.uniform(key, (), jnp.float32)

    u = jax.vmap(row_uniform)(md.rng_key, md.output_pos)  # [S] in [0, 1)
    # Inverse CDF: first id whose cumulative mass reaches (1-u)*total, with 1-u in (0, 1],
    # so a zero-probability (masked) id is never chosen. One uniform per row instead of
    # V Gumbels: threefry for S*V numbers cost ~90 ms at S=64 on CPU.
    cdf = jnp.cumsum(jnp.exp(z - zmax), -1)  # [S, V]
    target = (1.0 - u) * cdf[:, -1]
    ids = jnp.sum(cdf < target[:, None], -1).astype(jnp.int32)
    return jnp.minimum(ids, V - 1)


def _argmax_lowest(x: jax.Array) -> jax.Array:
    """Row argmax of x (f32[S, V]) with ties to the lowest id -> i32[S].

    Same result as jnp.argmax, but two vectorised reductions instead of XLA:CPU's
    variadic (value, index) reduce: 7 ms vs 33 ms at S=64, V=49152 (notes/sampler.md).
    """
    V = x.shape[-1]
    m = jnp.max(x, -1, keepdims=True)
    ids = jnp.min(jnp.where(x == m, jnp.arange(V, dtype=jnp.int32), V), -1)
    return jnp.minimum(ids, V - 1)  # a NaN row has no x == m; keep the id in range


# Rows per block when `sample` walks a larger S in blocks (`lax.map`): each pass over an
# [8, 49152] f32 block (1.6 MB) stays in cache, where one over [64, V] (12.6 MB) does not.
# Same-process, median ms (notes/perf.md, helper "attn"): S=64 36.6 whole / 19.2 (16) /
# 14.8 (8) / 15.4 (4); S=256 215 whole / 73 (8); S=16, 32 within noise.
SAMPLE_ROW_BLOCK = 8


def sample(logits: jax.Array, md: SamplingMetadata, *, max_logprobs: int,
           top_window: int = DEFAULT_TOP_WINDOW,
           logprobs_mode: str = "raw_logprobs") -> SamplerOutput:
    """Sample one token per row; rows in blocks of SAMPLE_ROW_BLOCK when S is a larger
    multiple of it (every step is per row, so the result is the same). See `_sample`."""
    S = logits.shape[0] if logits.ndim == 2 else 0
    blk = SAMPLE_ROW_BLOCK
    if S <= blk or S % blk or md.temperature.shape != (S,):
        return _sample(logits, md, max_logprobs=max_logprobs, top_window=top_window,
                       logprobs_mode=logprobs_mode)
    split = functools.partial(jax.tree.map, lambda x: x.reshape(S // blk, blk, *x.shape[1:]))
    out = jax.lax.map(lambda a: _sample(*a, max_logprobs=max_logprobs, top_window=top_window,
                                        logprobs_mode=logprobs_mode), split((logits, md)))
    return jax.tree.map(lambda x: x.reshape(S, *x.shape[2:]), out)


def _sample(logits: jax.Array, md: SamplingMetadata, *, max_logprobs: int,
            top_window: int = DEFAULT_TOP_WINDOW,
            logprobs_mode: str = "raw_logprobs") -> SamplerOutput:
    """Sample one token per row (pure; call it inside the engine's jitted step).

    Args:
      logits: f32[S, V] (other float dtypes are upcast) at the logits_indices of the step.
      md: SamplingMetadata for the same S.
      max_logprobs: static; how many top raw logprobs to return per row (0 allowed).
      top_window: static; largest-logit window for top-k/top-p before exact bisection.
      logprobs_mode: static; "raw_logprobs" or "processed_logprobs" (module docstring).

    Returns:
      SamplerOutput (token_ids i32[S], logprobs f32[S], top_ids i32[S, max_logprobs],
      top_logprobs f32[S, max_logprobs]).

    Raises:
      ValueError: logits not 2-D, md row count != S, max_logprobs outside [0, V],
        top_window < 1, or an unknown logprobs_mode.
    """
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode={logprobs_mode!r} must be one of {LOGPROBS_MODES}")
    if logits.ndim != 2:
        raise ValueError(f"logits.shape={logits.shape} must be [S, V]")
    S, V = logits.shape
    if md.temperature.shape != (S,):
        raise ValueError(f"md.temperature.shape={md.temperature.shape} != (S,)=({S},)")
    if not 0 <= max_logprobs <= V:
        raise ValueError(f"max_logprobs={max_logprobs} must be in [0, V={V}]")
    if top_window < 1:
        raise ValueError(f"top_window={top_window} must be >= 1")
    logits = logits.astype(jnp.float32)
    W = md.allowed_bitmask.shape[1]
    if W:  # static: [S, 0] means this caller never masks
        if W != (V + 31) // 32:
            raise ValueError(f"md.allowed_bitmask.shape={md.allowed_bitmask.shape} must be "
                             f"[S, ceil(V/32)={(V + 31) // 32}]")
    # logit_bias first (vLLM applies it with min_tokens, before penalties); ids are < V by
    # validation, and padding entries add 0 to id 0.
    bias_rows = jnp.broadcast_to(jnp.arange(S)[:, None], md.logit_bias_ids.shape)
    x = jax.lax.cond(
        jnp.any(md.logit_bias_values != 0.0),
        lambda: logits.at[bias_rows, md.logit_bias_ids].add(md.logit_bias_values, mode="drop"),
        lambda: logits)
    use_pen = ((md.repetition_penalty != 1.0) | (md.presence_penalty != 0.0)
               | (md.frequency_penalty != 0.0))
    x = jax.lax.cond(jnp.any(use_pen), lambda: apply_penalties(x, md), lambda: x)
    sup_rows = jnp.broadcast_to(jnp.arange(S)[:, None], md.suppress_ids.shape)
    sup_idx = jnp.where(md.suppress_ids >= 0, md.suppress_ids, V)
    x = x.at[sup_rows, sup_idx].set(-jnp.inf, mode="drop")
    if W:
        x = jax.lax.cond(jnp.all(md.allowed_bitmask == -1), lambda: x,
                         lambda: apply_bitmask(x, md.allowed_bitmask))
    # top_k == 1 is greedy too, so that ties go to the lowest id exactly as temperature=0 (C20).
    greedy = (md.temperature < SAMPLING_EPS) | (md.top_k == 1)
    greedy_ids = _argmax_lowest(x)
    if logprobs_mode == "processed_logprobs":
        base = filter_logits(x, md, greedy, top_window)  # the sampled distribution
        token_ids = jnp.where(greedy, greedy_ids, _sample_random(base, md))
    else:
        base = logits
        token_ids = jax.lax.cond(
            jnp.all(greedy), lambda: greedy_ids,
            lambda: jnp.where(greedy, greedy_ids,
                              _sample_random(filter_logits(x, md, greedy, top_window), md)))
    # logprob = (x - max) - log(sum(exp(x - max))), as jax.nn.log_softmax computes it,
    # but only at the S chosen ids and the top ids: no [S, V] log_softmax is materialised.
    zmax = jax.lax.stop_gradient(jnp.max(base, -1, keepdims=True))  # [S, 1]
    log_z = jnp.log(jnp.sum(jnp.exp(base - zmax), -1, keepdims=True))  # [S, 1]
    logprobs = ((jnp.take_along_axis(base, token_ids[:, None], -1) - zmax) - log_z)[:, 0]
    if max_logprobs > 0:
        top_vals, top_ids = jax.lax.top_k(base, max_logprobs)  # same order as the logprobs
        top_logprobs = (top_vals - zmax) - log_z
    else:
        top_logprobs = jnp.zeros((S, 0), jnp.float32)
        top_ids = jnp.zeros((S, 0), jnp.int32)
    return SamplerOutput(token_ids=token_ids, logprobs=logprobs,
                         top_ids=top_ids.astype(jnp.int32), top_logprobs=top_logprobs)
