"""Ragged paged attention: xla path and Pallas kernel (interpret=True) vs the float64 reference.

All batches share one bucket shape per (backend, dtype, heads) so each static
configuration compiles once per module; NaN poisoning of unused KV slots and of
padding query rows checks that nothing leaks into real rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.attention import CommonAttentionMetadata
from jaxserve.attention.common import num_query_tiles, query_tiles
from jaxserve.attention.pallas_triton import PallasTritonBackend, choose_block_q
from jaxserve.attention.reference import reference_ragged_paged_attention
from jaxserve.attention.xla import XlaBackend
from jaxserve.attention.kernels import ragged_paged_attention as rpa
from tests.attention.cases import named_mixes, random_batch

T_PAD, S_PAD, B, P, N = 64, 8, 16, 8, 72
MAX_LEN = P * B
TOL = {np.float32: 2e-5, jnp.bfloat16: 2e-2}


@functools.lru_cache(maxsize=None)
def _backend(name: str, num_queries_per_kv: int, head_dim: int, block_q: int | None):
    if name == "xla":
        return XlaBackend(block_size=B)
    return PallasTritonBackend(block_size=B, num_queries_per_kv=num_queries_per_kv,
                               head_dim=head_dim, block_q=block_q, interpret=True)


@functools.lru_cache(maxsize=None)
def _attention_fn(backend):
    return jax.jit(lambda q, kc, vc, md: backend.attention(q, kc, vc, md, layer=None,
                                                           sm_scale=q.shape[-1] ** -0.5))


def _mix_list():
    mixes = dict(named_mixes(B, MAX_LEN))
    mixes["many_at_max"] = ([1] * S_PAD, [MAX_LEN] * S_PAD)
    mixes["t_actual_eq_t_pad"] = ([20, 1, 30, 13], [20 + B, MAX_LEN, 30, 13 + 2 * B + 1])
    mixes["one_token"] = ([1], [1])
    return mixes


MIXES = _mix_list()


def _check(backend, mix, *, h, k, d, dtype=np.float32, seed=0, pallas_block_q=None):
    q_lens, seq_lens = MIXES[mix]
    batch = random_batch(np.random.default_rng(seed), q_lens=q_lens, seq_lens=seq_lens,
                         num_tokens=T_PAD, num_seqs=S_PAD, max_blocks_per_seq=P,
                         num_kv_blocks=N, block_size=B, num_heads=h, num_kv_heads=k,
                         head_dim=d, dtype=dtype)
    be = _backend(backend, h // k, d, pallas_block_q)
    md = be.prepare(CommonAttentionMetadata(**batch.common_kwargs()))
    out = _attention_fn(be)(
        jnp.asarray(batch.q), jnp.asarray(batch.k_cache), jnp.asarray(batch.v_cache),
        jax.tree.map(jnp.asarray, md))
    assert out.dtype == jnp.dtype(dtype) and out.shape == batch.q.shape
    out = np.asarray(out.astype(jnp.float32))
    ref = reference_ragged_paged_attention(
        batch.q.astype(np.float32), batch.k_cache.astype(np.float32),
        batch.v_cache.astype(np.float32), batch.query_start_loc, batch.seq_lens,
        batch.block_table, batch.num_seqs, sm_scale=d ** -0.5)
    n = batch.num_tokens
    assert np.isfinite(out[:n]).all(), "NaN leaked into a real row"
    np.testing.assert_allclose(out[:n], ref[:n], atol=TOL[dtype], rtol=TOL[dtype])
    # Padding rows are defined as 0 by both backends.
    assert np.all(out[n:] == 0.0)


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_xla_matches_reference_fp32(mix):
    _check("xla", mix, h=6, k=2, d=8)  # the tiny model's heads


@pytest.mark.parametrize("mix", ["mixed", "decode_only", "chunked_prefill"])
def test_xla_matches_reference_bf16_smollm2_heads(mix):
    _check("xla", mix, h=9, k=3, d=64, dtype=jnp.bfloat16)


@pytest.mark.parametrize("h,k", [(4, 4), (8, 2), (7, 1), (12, 4)])
def test_xla_gqa_ratios(h, k):
    _check("xla", "mixed", h=h, k=k, d=16, seed=h)


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_pallas_interpret_matches_reference_fp32(mix):
    _check("pallas", mix, h=6, k=2, d=16, pallas_block_q=16)


@pytest.mark.parametrize("mix", ["mixed", "decode_only"])
def test_pallas_interpret_decode_tile_bf16(mix):
    # The decode-bucket tile: 4 tokens x next_pow2(3) heads = 16 rows.
    _check("pallas", mix, h=6, k=2, d=16, dtype=jnp.bfloat16, pallas_block_q=4)


@pytest.mark.parametrize("h,k,bq", [(4, 4, 16), (7, 1, 2)])
def test_pallas_interpret_gqa_ratios(h, k, bq):
    _check("pallas", "chunked_prefill", h=h, k=k, d=16, seed=h, pallas_block_q=bq)


def test_pallas_rejects_shapes_triton_cannot_take():
    with pytest.raises(ValueError, match="head_dim=8"):
        rpa.check_kernel_shapes(head_dim=8, num_queries_per_kv=3, block_q=16, block_size=16,
                                pages_per_chunk=4)
    with pytest.raises(ValueError, match="block_q"):
        rpa.check_kernel_shapes(head_dim=64, num_queries_per_kv=3, block_q=2, block_size=16,
                                pages_per_chunk=4)


def test_query_tiles_hand_example():
    # seqs: q_len 5 (ctx 3), q_len 1 (ctx 9), padded slot; block_q 4
    t = query_tiles(np.array([0, 5, 6, 6]), np.array([8, 10, 0]), np.array([5, 1, 0]),
                        block_q=4, num_tiles=5)
    np.testing.assert_array_equal(t["tile_seq"], [0, 0, 1, 0, 0])
    np.testing.assert_array_equal(t["tile_q_start"], [0, 4, 5, 0, 0])
    np.testing.assert_array_equal(t["tile_pos0"], [3, 7, 9, 0, 0])
    np.testing.assert_array_equal(t["tile_kv_end"], [7, 8, 10, 0, 0])
    np.testing.assert_array_equal(t["num_tiles"], [3])
    with pytest.raises(ValueError, match="num_tiles=2"):
        query_tiles(np.array([0, 5, 6, 6]), np.array([8, 10, 0]), np.array([5, 1, 0]),
                        block_q=4, num_tiles=2)


def test_num_query_tiles_bound_holds():
    rng = np.random.default_rng(1)
    for _ in range(200):
        t, s, bq = int(rng.integers(1, 300)), int(rng.integers(1, 40)), int(rng.choice([1, 4, 16]))
        cuts = np.sort(rng.integers(0, t + 1, size=s - 1)) if s > 1 else np.array([], int)
        q = np.diff(np.concatenate([[0], cuts, [t]]))
        assert (-(-q // bq)).sum() <= num_query_tiles(t, s, bq)


def test_choose_block_q_by_bucket_kind():
    # SmolLM2's 9 / 3 heads pad to 4 rows per token: a decode bucket takes the 16-row minimum
    # of tl.dot (4 tokens), a prefill bucket 64-row tiles (16 tokens); H/K = 1 never goes below 16.
    assert choose_block_q(256, 256, 3) == 4
    assert choose_block_q(512, 64, 3) == 16
    assert choose_block_q(8, 8, 1) == 16
    assert choose_block_q(64, 4, 8) == 8
    # f32 above head_dim 128 keeps the 16-row tile (the 64-row one spills, issue 31)
    assert choose_block_q(64, 8, 4, head_dim=256, dtype="float32") == 4
    assert choose_block_q(64, 8, 4, head_dim=256, dtype="bfloat16") == 16
