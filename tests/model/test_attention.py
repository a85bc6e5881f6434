"""AttentionMetadata, write_kv and the backend switch of jaxserve/model/attention.py."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxserve.model import attention as attn
from jaxserve.pallas import kv_cache_update as kvu
from jaxserve.pallas import ragged_paged_attention as rpa
from tests.pallas.cases import random_batch

T, S, B, P, N, L = 32, 4, 16, 4, 20, 3
H, K, D = 6, 2, 8  # the tiny model's heads


def _batch(seed=0, poison=True):
    return random_batch(np.random.default_rng(seed), q_lens=[1, 19, 3], seq_lens=[40, 19, 17],
                        num_tokens=T, num_seqs=S, max_blocks_per_seq=P, num_kv_blocks=N,
                        block_size=B, num_heads=H, num_kv_heads=K, head_dim=D, poison=poison)


def test_default_backend_is_xla_on_cpu():
    assert attn.default_backend() == "xla"


def test_metadata_fields_and_static_split():
    b = _batch()
    md = attn.make_attention_metadata(**b.metadata_kwargs(), num_queries_per_kv=3)
    leaves, treedef = jax.tree.flatten(md)
    assert all(isinstance(x, np.ndarray) and x.dtype == np.int32 for x in leaves)
    np.testing.assert_array_equal(md.decode_token_idx, [0, T, T, T])
    np.testing.assert_array_equal(md.decode_kv_len, [40, 0, 0, 0])
    assert md.prefill_num_tiles[0] == 2  # 19 and 3 tokens, one 32-token tile each
    np.testing.assert_array_equal(md.prefill_tile_pos0[:2], [0, 14])
    np.testing.assert_array_equal(md.prefill_tile_kv_end[:2], [19, 17])
    # padding tokens map to no output row
    assert np.all(md.token_out_row[23:] == -1) and np.all(md.token_out_row[:23] >= 0)
    # static fields are part of the treedef (a different block size is a new program)
    md2 = attn.make_attention_metadata(**b.metadata_kwargs(), pallas_block_q=8)
    assert jax.tree.structure(md2) != treedef


@pytest.mark.parametrize("bad,match", [
    (dict(num_seqs=5), "num_seqs=5"),
    (dict(seq_lens=np.array([40, 2, 17, 0], np.int32)), "seq_lens"),
    (dict(seq_lens=np.array([65, 19, 17, 0], np.int32)), "max_blocks_per_seq"),
    (dict(query_start_loc=np.array([0, 1, 20, 40, 40], np.int32)), "T_pad=32"),
    (dict(block_table=np.zeros((3, P), np.int32)), "inconsistent shapes"),
])
def test_metadata_rejects_bad_input(bad, match):
    kw = _batch().metadata_kwargs() | bad
    with pytest.raises(ValueError, match=match):
        attn.make_attention_metadata(**kw)


@functools.lru_cache(maxsize=None)
def _write_fn(backend, stacked):
    def f(kc, vc, k, v, md, layer):
        return attn.write_kv(kc, vc, k, v, md, layer=layer if stacked else None,
                             backend=backend, interpret=True)
    return jax.jit(f)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
@pytest.mark.parametrize("stacked", [True, False])
def test_write_kv_matches_reference(backend, stacked):
    b = _batch(poison=False)
    rng = np.random.default_rng(5)
    kc = rng.standard_normal((L, N, B, K, D)).astype(np.float32)
    vc = rng.standard_normal((L, N, B, K, D)).astype(np.float32)
    k = rng.standard_normal((T, K, D)).astype(np.float32)
    v = rng.standard_normal((T, K, D)).astype(np.float32)
    md = jax.tree.map(jnp.asarray, attn.make_attention_metadata(**b.metadata_kwargs()))
    layer = 1
    if stacked:
        got = _write_fn(backend, True)(kc, vc, k, v, md, jnp.int32(layer))
    else:
        got = _write_fn(backend, False)(kc[layer], vc[layer], k, v, md, None)
        got = tuple(np.asarray(x)[None] for x in got)
        kc, vc, layer = kc[layer:layer + 1], vc[layer:layer + 1], 0
    want = kvu.reference_write_kv(kc, vc, k, v, b.slot_mapping, layer,
                                  num_real_tokens=b.num_tokens)
    for g, w in zip(got, want):
        g = np.asarray(g)
        # block 0 receives the padding tokens' rows in an unspecified order
        np.testing.assert_array_equal(g[:, 1:], w[:, 1:])
    assert np.any(np.asarray(got[0])[layer, 1:] != kc[layer, 1:])  # something was written


def test_scan_over_layers_with_cache_carry_matches_per_layer_calls():
    """The lead's pattern: stacked caches as the scan carry, write then attend per layer."""
    b = _batch(poison=False)
    md = jax.tree.map(jnp.asarray, attn.make_attention_metadata(**b.metadata_kwargs()))
    rng = np.random.default_rng(7)
    kc = rng.standard_normal((L, N, B, K, D)).astype(np.float32)
    vc = kc + 1.0
    x = rng.standard_normal((L, T, H, D)).astype(np.float32)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(kc, vc, x, md):
        def body(carry, inp):
            kc, vc = carry
            li, xl = inp
            kc, vc = attn.write_kv(kc, vc, xl[:, :K], xl[:, K:2 * K], md, layer=li)
            o = attn.attention(xl, kc, vc, md, layer=li, sm_scale=0.3)
            return (kc, vc), o
        (kc, vc), o = lax.scan(body, (kc, vc), (jnp.arange(L, dtype=jnp.int32), x))
        return o, kc, vc

    o, kc2, vc2 = step(jnp.asarray(kc), jnp.asarray(vc), jnp.asarray(x), md)
    for li in range(L):
        kl, vl = kvu.reference_write_kv(kc[li:li + 1], vc[li:li + 1], x[li, :, :K],
                                        x[li, :, K:2 * K], b.slot_mapping, 0,
                                        num_real_tokens=b.num_tokens)
        np.testing.assert_array_equal(np.asarray(kc2)[li, 1:], kl[0, 1:])
        np.testing.assert_array_equal(np.asarray(vc2)[li, 1:], vl[0, 1:])
        ref = rpa.reference_ragged_paged_attention(
            x[li], kl[0], vl[0], b.query_start_loc, b.seq_lens, b.block_table, b.num_seqs,
            sm_scale=0.3)
        np.testing.assert_allclose(np.asarray(o[li]), ref, atol=2e-5, rtol=2e-5)


def test_bad_backend_and_shapes_raise():
    b = _batch()
    md = attn.make_attention_metadata(**b.metadata_kwargs())
    q = jnp.zeros((T, H, D))
    kc = jnp.zeros((N, B, K, D))
    with pytest.raises(ValueError, match="backend='tpu'"):
        attn.attention(q, kc, kc, md, sm_scale=1.0, backend="tpu")
    with pytest.raises(ValueError, match="stacked cache"):
        attn.attention(q, kc, kc, md, layer=0, sm_scale=1.0)
    with pytest.raises(ValueError, match="does not fit"):
        attn.attention(jnp.zeros((T, 5, D)), kc, kc, md, sm_scale=1.0)


@pytest.mark.parametrize("chunk", [16, 32])
@pytest.mark.parametrize("mulsum", [True, False])
def test_xla_split_kv_decode_many_items_per_row(monkeypatch, chunk, mulsum):
    # Small KV chunks give rows of 1..8 split-KV work items (ragged, with padded slots and
    # poisoned unused pages), so the item walk and the per-row merge are both exercised.
    from tests.pallas.cases import random_batch as rb
    monkeypatch.setattr(attn, "XLA_DECODE_CHUNK", chunk)
    monkeypatch.setattr(attn, "XLA_DECODE_MULSUM", mulsum)
    bs, p, s_pad = 16, 8, 8
    q_lens, seq_lens = [1] * 6, [1, 15, 16, 17, 100, 128]
    batch = rb(np.random.default_rng(3), q_lens=q_lens, seq_lens=seq_lens, num_tokens=8,
               num_seqs=s_pad, max_blocks_per_seq=p, num_kv_blocks=72, block_size=bs,
               num_heads=H, num_kv_heads=K, head_dim=D)
    md = attn.make_attention_metadata(**batch.metadata_kwargs())
    fn = jax.jit(lambda q, kc, vc, md: attn.attention(q, kc, vc, md, sm_scale=D ** -0.5))
    out = np.asarray(fn(jnp.asarray(batch.q), jnp.asarray(batch.k_cache),
                        jnp.asarray(batch.v_cache), jax.tree.map(jnp.asarray, md)))
    ref = rpa.reference_ragged_paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens,
        batch.block_table, batch.num_seqs, sm_scale=D ** -0.5)
    n = batch.num_tokens
    assert np.isfinite(out[:n]).all()
    np.testing.assert_allclose(out[:n], ref[:n], atol=1e-5, rtol=1e-5)
    assert np.all(out[n:] == 0.0)
