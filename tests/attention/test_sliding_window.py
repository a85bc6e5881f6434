"""Sliding-window attention in every attention path against the float64 reference.

Windows of 1 key, of one page, of a non-multiple of the page, and longer than any
context, on ragged mixes of decodes, fresh prefills and chunked prefills. Every KV
slot that no query of its sequence sees (before the first query's window, past the
end, unused) is NaN, so a path that reads a page wholly outside the window (or a key
before the window in the edge page) without masking it fails the comparison.
The window is data: one traced program serves every window (checked by a trace count).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.attention import CommonAttentionMetadata, native_cpu
from jaxserve.attention.pallas_triton import PallasTritonBackend
from jaxserve.attention.reference import reference_ragged_paged_attention
from jaxserve.attention.xla import XlaBackend
from tests.attention.cases import random_batch

B = 16
WINDOWS = (1, B, 21, 1000)  # one key, one page, not a multiple of the page, > any context
# (q_lens, seq_lens): decodes at several context lengths, a fresh prefill, chunked prefills
MIX = ([1, 19, 1, 7, 1, 3], [40, 19, 1, 7 + 2 * B + 3, 3 * B + 5, 17])


def poison_outside_window(batch, window: int) -> None:
    """NaN into every live KV slot that no query of its sequence sees (in place)."""
    for s in range(batch.num_seqs):
        n = int(batch.seq_lens[s])
        q_len = int(batch.query_start_loc[s + 1] - batch.query_start_loc[s])
        first = n - q_len  # position of the sequence's first query
        for pos in range(max(0, first - window + 1)):
            page = batch.block_table[s, pos // batch.block_size]
            batch.k_cache[page, pos % batch.block_size] = np.nan
            batch.v_cache[page, pos % batch.block_size] = np.nan


def make_batch(window, *, h=6, k=2, d=8, seed=0, num_tokens=48, mix=MIX, dtype=np.float32):
    q_lens, seq_lens = mix
    batch = random_batch(np.random.default_rng(seed), q_lens=q_lens, seq_lens=seq_lens,
                         num_tokens=num_tokens, num_seqs=len(q_lens) + 1, max_blocks_per_seq=4,
                         num_kv_blocks=4 * (len(q_lens) + 1) + 1, block_size=B, num_heads=h,
                         num_kv_heads=k, head_dim=d)
    poison_outside_window(batch, window)
    for f in ("q", "k_cache", "v_cache"):
        setattr(batch, f, getattr(batch, f).astype(dtype))
    return batch


def reference(batch, window):
    d = batch.q.shape[-1]
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    return reference_ragged_paged_attention(
        f32(batch.q), f32(batch.k_cache), f32(batch.v_cache), batch.query_start_loc,
        batch.seq_lens, batch.block_table, batch.num_seqs, sm_scale=d ** -0.5,
        sliding_window=window)


def run(backend, batch, window):
    md = jax.device_put(backend.prepare(CommonAttentionMetadata(**batch.common_kwargs())))
    d = batch.q.shape[-1]
    out = backend.attention(jnp.asarray(batch.q), jnp.asarray(batch.k_cache),
                            jnp.asarray(batch.v_cache), md, layer=None, sm_scale=d ** -0.5,
                            sliding_window=jnp.int32(window))
    return np.asarray(out.astype(jnp.float32))


def check(out, ref, n, tol=2e-5):
    assert np.isfinite(out[:n]).all(), "NaN leaked from a slot outside the window"
    np.testing.assert_allclose(out[:n], ref[:n], atol=tol, rtol=tol)
    assert np.all(out[n:] == 0.0)


def test_reference_window_longer_than_context_is_plain_causal():
    batch = make_batch(1000)
    np.testing.assert_array_equal(reference(batch, 1000), reference(batch, None))


def test_reference_window_of_one_returns_own_value():
    """A query that sees only itself outputs its own value row (hand computation)."""
    batch = make_batch(1, h=2, k=2)
    ref = reference(batch, 1)
    for s in range(batch.num_seqs):
        lo, hi = batch.query_start_loc[s], batch.query_start_loc[s + 1]
        n = batch.seq_lens[s]
        for i, t in enumerate(range(lo, hi)):
            pos = n - (hi - lo) + i
            page = batch.block_table[s, pos // B]
            np.testing.assert_allclose(ref[t], batch.v_cache[page, pos % B], rtol=1e-12)


@pytest.mark.parametrize("impl", ["native", "online", "split_kv"])
def test_xla_sliding_window_matches_reference(impl):
    if impl == "native" and not native_cpu.available():
        pytest.fail(f"native kernel unavailable: {native_cpu.unavailable_reason()}")
    be = XlaBackend(block_size=B, decode_impl=impl, block_q=8, prefill_chunk=32,
                    decode_chunk=32, native_chunk_pages=1)
    traces = []

    @jax.jit
    def attn(q, kc, vc, md, window):
        traces.append(1)
        return be.attention(q, kc, vc, md, layer=None, sm_scale=8 ** -0.5, sliding_window=window)

    for window in WINDOWS:
        batch = make_batch(window)
        md = jax.device_put(be.prepare(CommonAttentionMetadata(**batch.common_kwargs())))
        out = np.asarray(attn(jnp.asarray(batch.q), jnp.asarray(batch.k_cache),
                              jnp.asarray(batch.v_cache), md, jnp.int32(window)))
        check(out, reference(batch, window), batch.num_tokens)
    assert len(traces) == 1, "the window must be data, not a new program"


@pytest.mark.parametrize("window", WINDOWS)
def test_pallas_triton_sliding_window_matches_reference(window):
    be = PallasTritonBackend(block_size=B, num_queries_per_kv=3, head_dim=16, block_q=8,
                             chunk_keys=16, dtype="float32", interpret=True)
    batch = make_batch(window, d=16)
    check(run(be, batch, window), reference(batch, window), batch.num_tokens, tol=1e-4)


@pytest.mark.parametrize("window", WINDOWS)
def test_pallas_mosaic_sliding_window_matches_reference(window):
    from jaxserve.attention.pallas_mosaic import PallasMosaicBackend

    be = PallasMosaicBackend(block_size=B, num_queries_per_kv=4, head_dim=64, dtype="bfloat16",
                             interpret=True)
    # K = 1 and few tiles: the GPU interpreter costs ~0.3 s per program
    mix = ([1, 9, 1, 5], [40, 9, 3 * B + 5, 5 + 2 * B + 3])
    batch = make_batch(window, h=4, k=1, d=64, num_tokens=16, mix=mix, dtype=jnp.bfloat16)
    check(run(be, batch, window), reference(batch, window), batch.num_tokens, tol=2e-2)


def test_native_decode_rejects_a_window_below_one():
    batch = make_batch(1000)
    be = XlaBackend(block_size=B)
    md = jax.device_put(be.prepare(CommonAttentionMetadata(**batch.common_kwargs())))
    with pytest.raises(Exception, match="window 0 must be > 0"):
        np.asarray(be.attention(jnp.asarray(batch.q), jnp.asarray(batch.k_cache),
                                jnp.asarray(batch.v_cache), md, layer=None, sm_scale=1.0,
                                sliding_window=jnp.int32(0)))
