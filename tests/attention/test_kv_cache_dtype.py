"""16-bit KV caches (`--kv_cache_dtype`, issue 26) in the attention backends: the native CPU
decode kernel and the jnp paths read f16 / bf16 caches as f32, against a float64 reference
of attention over the same 16-bit values."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxserve.attention import CommonAttentionMetadata, native_cpu
from jaxserve.attention.reference import reference_ragged_paged_attention
from jaxserve.attention.xla import XlaBackend
from tests.attention.cases import random_batch

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def _case(name, heads):
    """A NaN-poisoned batch in the engine layout (max_model_len-wide block tables)."""
    if name == "decode_only":  # ragged decodes, one at a long context
        q_lens, seq_lens, t_pad, s_pad = [1] * 5, [1, 15, 17, 300, 2048], 8, 16
    else:  # decodes beside a chunked prefill and a fresh prompt (prefill on the jnp path)
        q_lens, seq_lens, t_pad, s_pad = [1, 40, 1, 1, 23], [700, 130, 1, 33, 23], 128, 16
    h, kh, d = heads
    need = sum(-(-s // 16) for s in seq_lens)
    return random_batch(np.random.default_rng(23), q_lens=q_lens, seq_lens=seq_lens,
                        num_tokens=t_pad, num_seqs=s_pad, max_blocks_per_seq=128,
                        num_kv_blocks=need + 9, block_size=16, num_heads=h, num_kv_heads=kh,
                        head_dim=d)


def _check(be, batch, dtype, *, target):
    """be.attention over the batch's caches rounded to `dtype` (NaN stays NaN) equals the
    float64 reference over those same 16-bit values within 1e-5; `target` (or None: no
    native call) is the custom call the program must contain."""
    kc16 = batch.k_cache.astype(DTYPES[dtype])
    vc16 = batch.v_cache.astype(DTYPES[dtype])
    md = jax.tree.map(jnp.asarray, be.prepare(CommonAttentionMetadata(**batch.common_kwargs())))
    d = batch.q.shape[-1]
    fn = jax.jit(functools.partial(be.attention, layer=None, sm_scale=d ** -0.5))
    args = (jnp.asarray(batch.q), jnp.asarray(kc16), jnp.asarray(vc16), md)
    text = fn.lower(*args).as_text()
    for t, _ in native_cpu.TARGETS.values():
        assert (t in text) == (t == target), (t, target)
    out = np.asarray(fn(*args))
    ref = reference_ragged_paged_attention(
        batch.q, kc16.astype(np.float64), vc16.astype(np.float64), batch.query_start_loc,
        batch.seq_lens, batch.block_table, batch.num_seqs, sm_scale=d ** -0.5)
    n = batch.num_tokens
    assert np.isfinite(out[:n]).all()
    np.testing.assert_allclose(out[:n], ref[:n], rtol=1e-5, atol=1e-5)
    assert np.all(out[n:] == 0.0)


@pytest.mark.parametrize("heads", [(6, 2, 8), (9, 3, 64)], ids=["tiny", "smollm2"])
@pytest.mark.parametrize("case", ["decode_only", "mixed"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_native_decode_reads_16bit_caches(dtype, case, heads):
    # The native kernel's f16 / bf16 handlers (the SmolLM2 geometry runs its specialised
    # body with the AVX2 row conversion; the tiny one, rows of 16, the same 8-wide path).
    assert native_cpu.available(), native_cpu.unavailable_reason()
    _check(XlaBackend(block_size=16, native_chunk_pages=4), _case(case, heads), dtype,
           target=native_cpu.TARGETS[dtype][0])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_jnp_paths_read_16bit_caches(dtype):
    # decode_impl="online": the decode items and the prefill tiles both upcast after the
    # gather (the XLA path of other platforms).
    _check(XlaBackend(block_size=16, decode_impl="online"), _case("mixed", (6, 2, 8)), dtype,
           target=None)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_native_decode_odd_head_dim_takes_the_row_conversion_path(dtype):
    # D = 5 (not a multiple of 8): the kernel's non-register path; K * D = 15 elements per
    # row: one 8-wide conversion and a 7-element scalar tail (exact for f16 subnormals
    # too: the keys below 6.1e-5 are f16 subnormals).
    rng = np.random.default_rng(3)
    dt = DTYPES.get(dtype, np.float32)
    kc = (rng.standard_normal((1, 4, 16, 3, 5)) * 1e-4).astype(dt)
    vc = rng.standard_normal((1, 4, 16, 3, 5)).astype(dt)
    q = rng.standard_normal((2, 3, 2, 5)).astype(np.float32) * 1e4
    kv_len, pages = np.array([37, 5], np.int32), np.array([[2, 1, 3], [3, 0, 0]], np.int32)
    out = np.asarray(native_cpu.paged_decode(q, kv_len, pages, kc, vc, 0, sm_scale=0.5,
                                             chunk_pages=1))
    for s in range(2):
        keys = np.concatenate([kc[0, p] for p in pages[s]])[:kv_len[s]].astype(np.float64)
        vals = np.concatenate([vc[0, p] for p in pages[s]])[:kv_len[s]].astype(np.float64)
        sc = np.einsum("kgd,tkd->kgt", q[s].astype(np.float64), keys) * 0.5
        p = np.exp(sc - sc.max(-1, keepdims=True))
        want = np.einsum("kgt,tkd->kgd", p / p.sum(-1, keepdims=True), vals)
        np.testing.assert_allclose(out[s], want, rtol=1e-5, atol=1e-5)


def test_native_decode_rejects_mixed_cache_dtypes():
    kc = jnp.zeros((1, 2, 16, 2, 8), jnp.float16)
    with pytest.raises(ValueError, match="one dtype"):
        native_cpu.paged_decode(jnp.ones((1, 2, 3, 8)), jnp.ones((1,), jnp.int32),
                                jnp.ones((1, 1), jnp.int32), kc, kc.astype(jnp.float32), 0,
                                sm_scale=1.0, chunk_pages=1)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_pallas_triton_reads_16bit_caches(dtype):
    # The Triton kernel (Pallas interpreter) upcasts the rows it loads to q's dtype.
    from jaxserve.attention.pallas_triton import PallasTritonBackend
    be = PallasTritonBackend(block_size=16, num_queries_per_kv=3, head_dim=16, interpret=True)
    batch = random_batch(np.random.default_rng(29), q_lens=[1, 19, 3], seq_lens=[40, 19, 17],
                         num_tokens=32, num_seqs=4, max_blocks_per_seq=4, num_kv_blocks=12,
                         block_size=16, num_heads=6, num_kv_heads=2, head_dim=16)
    _check(be, batch, dtype, target=None)


def test_pallas_mosaic_refuses_a_cache_not_in_the_model_dtype():
    from jaxserve.attention.pallas_mosaic import PallasMosaicBackend
    be = PallasMosaicBackend(block_size=16, num_queries_per_kv=3, head_dim=64, dtype="float32",
                             interpret=True)
    kc = jnp.zeros((2, 16, 2, 64), jnp.float16)
    with pytest.raises(ValueError, match="kv_cache_dtype=float16"):
        be.attention(jnp.zeros((8, 6, 64)), kc, kc, None, layer=None, sm_scale=1.0)
