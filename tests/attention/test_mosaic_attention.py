"""Mosaic GPU ragged paged attention in the GPU interpreter (bf16) vs the float64 reference.

Runs on CPU: `plgpu.InterpretGPUParams` simulates SMEM, TMA copies, mbarriers and
WGMMA (uninitialized SMEM reads as NaN, out-of-bounds reads raise). Every batch has
NaN-poisoned unused KV slots and padding query rows and a permuted block table
(tests/attention/cases.py), so reading past a sequence's end, a wrong page, or a padded
row leaking into a real one fails the comparison. The interpreter costs ~0.3 s per
program (tile x KV head) here, so the buckets are small and K = 1 where the KV-head
index is not what is being tested.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.attention import CommonAttentionMetadata
from jaxserve.attention.pallas_mosaic import PallasMosaicBackend
from jaxserve.attention.reference import reference_ragged_paged_attention
from jaxserve.attention.kernels import ragged_paged_attention_mosaic as rpm
from tests.attention.cases import random_batch

B = 16  # tokens per page; pages_per_chunk 4 -> 64-key chunks
TOL = {jnp.dtype(jnp.bfloat16): 2e-2, jnp.dtype(jnp.float32): 5e-5}


def run_case(q_lens, seq_lens, *, h, k, d, tiles=None, dtype=jnp.bfloat16, num_tokens=32,
             num_seqs=None, max_pages=8, seed=0, interpret=True, layers=1):
    """Build a poisoned batch, run the kernel in interpret mode, return (out, ref, n_real).

    With layers > 1 the batch's cache sits in the last layer of a stacked cache whose
    other layers are NaN, so reading the wrong layer fails too.
    """
    tiles = tiles or rpm.default_tiles(h // k, B)
    num_seqs = num_seqs or len(q_lens) + 1  # one padded sequence slot
    batch = random_batch(np.random.default_rng(seed), q_lens=q_lens, seq_lens=seq_lens,
                         num_tokens=num_tokens, num_seqs=num_seqs, max_blocks_per_seq=max_pages,
                         num_kv_blocks=num_seqs * max_pages + 1, block_size=B, num_heads=h,
                         num_kv_heads=k, head_dim=d, dtype=dtype)
    be = PallasMosaicBackend(block_size=B, num_queries_per_kv=h // k, head_dim=d,
                             dtype=jnp.dtype(dtype).name, tiles=tiles, interpret=interpret)
    md = be.prepare(CommonAttentionMetadata(**batch.common_kwargs()))

    def stacked(c):
        out = np.full((layers,) + c.shape, np.nan, c.dtype)
        out[-1] = c
        return jnp.asarray(out)

    out = be.attention(jnp.asarray(batch.q), stacked(batch.k_cache), stacked(batch.v_cache),
                       jax.device_put(md), layer=jnp.int32(layers - 1), sm_scale=d ** -0.5)
    assert out.shape == batch.q.shape and out.dtype == jnp.dtype(dtype)
    ref = reference_ragged_paged_attention(
        batch.q.astype(np.float32), batch.k_cache.astype(np.float32),
        batch.v_cache.astype(np.float32), batch.query_start_loc, batch.seq_lens,
        batch.block_table, batch.num_seqs, sm_scale=d ** -0.5)
    return np.asarray(out.astype(jnp.float32)), ref, batch.num_tokens


def assert_matches(out, ref, n, dtype=jnp.bfloat16):
    """Real rows finite and within tolerance of the reference; padding rows exactly 0."""
    assert np.isfinite(out[:n]).all(), "NaN leaked into a real row"
    tol = TOL[jnp.dtype(dtype)]
    np.testing.assert_allclose(out[:n], ref[:n], atol=tol, rtol=tol)
    assert np.all(out[n:] == 0.0)


# (q_lens, seq_lens). "mixed" holds a decode at exactly 4 pages (= one 64-key chunk),
# a fresh prefill, a zero-query sequence with context, a chunked prefill crossing a
# page boundary and a decode at 100 keys (2 chunks, partial last page).
MIXES = {
    "mixed": ([1, 20, 0, 5, 1], [64, 20, 40, 37, 100]),
    "decode_only": ([1] * 6, [1, B - 1, B, B + 1, 3 * B, 8 * B]),
    "prefill_only": ([5, 17, 9], [5, 17, 9]),
    "chunked_prefill": ([7, 20, 2], [7 + 2 * B + 3, 20 + 44, 2 + B - 1]),
}


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_mixes_match_reference_gqa4_d64(mix):
    q_lens, seq_lens = MIXES[mix]
    assert_matches(*run_case(q_lens, seq_lens, h=4, k=1, d=64))


def test_two_kv_heads_and_a_stacked_cache_d128():
    # K = 2 checks the KV-head index of the page copies and the Q/O tiles; layer 1 of
    # a 2-layer cache whose layer 0 is NaN checks the traced layer index.
    out, ref, n = run_case([1, 9, 1], [33, 9 + 40, 64], h=8, k=2, d=128, layers=2, seed=3)
    assert_matches(out, ref, n)


@pytest.mark.parametrize("h,k", [(8, 1), (3, 1)])
def test_gqa_ratios_pad_heads(h, k):
    # G = 8 -> 8-token tiles; G = 3 pads to Gp = 4 (the padded head rows are dropped).
    assert_matches(*run_case([1, 12, 3], [50, 12, 3 + B], h=h, k=k, d=64, seed=h))


def test_prefill_tiles_of_128_rows_span_several_tiles():
    # block_q 32 x Gp 4 = 128 rows (two WGMMA row groups); 40 tokens -> 2 tiles.
    tiles = rpm.default_tiles(4, B, head_dim=64, decode=False)
    assert tiles.block_q == 32
    assert_matches(*run_case([40, 1], [40 + 7, 90], h=4, k=1, d=64, tiles=tiles,
                             num_tokens=48))
