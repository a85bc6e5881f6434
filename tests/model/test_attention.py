"""The attention backends of jaxserve/model/attention/: prepare, write_kv, the factory."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxserve.config import ModelConfig
from jaxserve.attention import CommonAttentionMetadata, get_attention_backend, native_cpu
from jaxserve.attention.pallas_triton import PallasTritonBackend
from jaxserve.attention.reference import reference_ragged_paged_attention, reference_write_kv
from jaxserve.attention.xla import XlaBackend
from tests.attention.cases import named_mixes, random_batch

T, S, B, P, N, L = 32, 4, 16, 4, 20, 3
H, K, D = 6, 2, 8  # the tiny model's heads
D_PALLAS = 16  # the smallest head_dim the Triton kernels tile


def _batch(seed=0, poison=True):
    return random_batch(np.random.default_rng(seed), q_lens=[1, 19, 3], seq_lens=[40, 19, 17],
                        num_tokens=T, num_seqs=S, max_blocks_per_seq=P, num_kv_blocks=N,
                        block_size=B, num_heads=H, num_kv_heads=K, head_dim=D, poison=poison)


def _pallas(block_q=None, head_dim=D_PALLAS):
    return PallasTritonBackend(block_size=B, num_queries_per_kv=H // K, head_dim=head_dim,
                               block_q=block_q, interpret=True)


def test_factory_names_and_aliases():
    cfg = ModelConfig.tiny(head_dim=16)
    assert get_attention_backend("auto", cfg, block_size=B).name == "xla"  # CPU
    assert get_attention_backend("xla", cfg, block_size=B) == XlaBackend(block_size=B)
    for name in ("pallas", "pallas_triton"):
        be = get_attention_backend(name, cfg, block_size=B, interpret=True)
        assert be.name == "pallas_triton" and be.interpret
    with pytest.raises(ValueError, match="'tpu' is not one of"):
        get_attention_backend("tpu", cfg, block_size=B)
    with pytest.raises(ValueError, match="needs a GPU.*cpu"):
        get_attention_backend("pallas", cfg, block_size=B)
    with pytest.raises(ValueError, match="head_dim=8"):  # the tiny model cannot tile
        get_attention_backend("pallas_triton", ModelConfig.tiny(), block_size=B, interpret=True)


def test_xla_metadata_holds_only_its_tiling():
    md = XlaBackend(block_size=B).prepare(CommonAttentionMetadata(**_batch().common_kwargs()))
    leaves = jax.tree.leaves(md)
    assert all(isinstance(x, np.ndarray) and x.dtype == np.int32 for x in leaves)
    assert not hasattr(md, "tile_seq") and not hasattr(md, "token_out_row")
    np.testing.assert_array_equal(md.decode_token_idx, [0, T, T, T])
    np.testing.assert_array_equal(md.decode_kv_len, [40, 0, 0, 0])
    assert md.prefill_num_tiles[0] == 2  # 19 and 3 tokens, one 32-token tile each
    np.testing.assert_array_equal(md.prefill_tile_pos0[:2], [0, 14])
    np.testing.assert_array_equal(md.prefill_tile_kv_end[:2], [19, 17])


def test_pallas_metadata_tiles_and_static_block_q():
    common = CommonAttentionMetadata(**_batch().common_kwargs())
    md = _pallas().prepare(common)
    leaves, treedef = jax.tree.flatten(md)
    assert all(isinstance(x, np.ndarray) and x.dtype == np.int32 for x in leaves)
    assert not hasattr(md, "decode_token_idx")
    # T=32 > 2 * S: a prefill-like bucket takes 64-row tiles, 64 / next_pow2(6 / 2) = 16 tokens.
    assert md.block_q == 16
    # padding tokens map to no output row
    assert np.all(md.token_out_row[23:] == -1) and np.all(md.token_out_row[:23] >= 0)
    # the first token of sequence 1 (flat index 1) starts tile 1 (sequence 0 has one tile)
    assert md.token_out_row[1] == 1 * 16
    # static fields are part of the treedef (a different block_q is a new program)
    assert jax.tree.structure(_pallas(block_q=8).prepare(common)) != treedef


@pytest.mark.parametrize("bad,match", [
    (dict(num_seqs=5), "num_seqs=5"),
    (dict(seq_lens=np.array([40, 2, 17, 0], np.int32)), "seq_lens"),
    (dict(seq_lens=np.array([65, 19, 17, 0], np.int32)), "max_blocks_per_seq"),
    (dict(query_start_loc=np.array([0, 1, 20, 40, 40], np.int32)), "T_pad=32"),
    (dict(block_table=np.zeros((3, P), np.int32)), "inconsistent shapes"),
])
@pytest.mark.parametrize("backend", [XlaBackend(block_size=B), _pallas()], ids=["xla", "pallas"])
def test_prepare_rejects_bad_input(backend, bad, match):
    common = CommonAttentionMetadata(**(_batch().common_kwargs() | bad))
    with pytest.raises(ValueError, match=match):
        backend.prepare(common)


@functools.lru_cache(maxsize=None)
def _write_fn(backend, stacked):
    def f(kc, vc, k, v, md, layer):
        return backend.write_kv(kc, vc, k, v, md, layer=layer if stacked else None)
    return jax.jit(f)


@pytest.mark.parametrize("backend", [XlaBackend(block_size=B), _pallas()], ids=["xla", "pallas"])
@pytest.mark.parametrize("stacked", [True, False])
def test_write_kv_matches_reference(backend, stacked):
    b = _batch(poison=False)
    rng = np.random.default_rng(5)
    d = D_PALLAS
    kc = rng.standard_normal((L, N, B, K, d)).astype(np.float32)
    vc = rng.standard_normal((L, N, B, K, d)).astype(np.float32)
    k = rng.standard_normal((T, K, d)).astype(np.float32)
    v = rng.standard_normal((T, K, d)).astype(np.float32)
    md = jax.tree.map(jnp.asarray, backend.prepare(CommonAttentionMetadata(**b.common_kwargs())))
    layer = 1
    if stacked:
        got = _write_fn(backend, True)(kc, vc, k, v, md, jnp.int32(layer))
    else:
        got = _write_fn(backend, False)(kc[layer], vc[layer], k, v, md, None)
        got = tuple(np.asarray(x)[None] for x in got)
        kc, vc, layer = kc[layer:layer + 1], vc[layer:layer + 1], 0
    want = reference_write_kv(kc, vc, k, v, b.slot_mapping, layer, num_real_tokens=b.num_tokens)
    for g, w in zip(got, want):
        g = np.asarray(g)
        # block 0 receives the padding tokens' rows in an unspecified order
        np.testing.assert_array_equal(g[:, 1:], w[:, 1:])
    assert np.any(np.asarray(got[0])[layer, 1:] != kc[layer, 1:])  # something was written


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "per_layer"])
@pytest.mark.parametrize("slot", [0, 37, N * B - 1], ids=["null_block", "mid", "last_slot"])
def test_xla_write_kv_one_token_matches_reference_in_place(stacked, slot):
    # T = 1 takes `write_one_row` (a dynamic-update-slice, not the scatter): the one row
    # lands at its slot, every other slot keeps its value (NaN-poisoned here: no NaN may
    # move or vanish), and the donated per-layer program updates the cache in place: no
    # copy of a whole cache in the compiled HLO (XLA's scatter form copied it ~5 times).
    be = XlaBackend(block_size=B)
    rng = np.random.default_rng(slot)
    kc = rng.standard_normal((L, N, B, K, D)).astype(np.float32)
    vc = rng.standard_normal((L, N, B, K, D)).astype(np.float32)
    kc[:, 3], vc[:, 5] = np.nan, np.nan
    k = rng.standard_normal((1, K, D)).astype(np.float32)
    v = rng.standard_normal((1, K, D)).astype(np.float32)
    common = CommonAttentionMetadata(
        slot_mapping=np.array([slot], np.int32), query_start_loc=np.array([0, 1], np.int32),
        seq_lens=np.array([slot % B + 1], np.int32),
        block_table=np.array([[slot // B]], np.int32), num_seqs=np.array([1], np.int32))
    md = jax.tree.map(jnp.asarray, be.prepare(common))
    layer = 2
    if stacked:  # every layer compared: nothing written outside layer 2
        got = _write_fn(be, True)(kc, vc, k, v, md, jnp.int32(layer))
        want_k, want_v = kc.copy(), vc.copy()
        want_k[layer, slot // B, slot % B], want_v[layer, slot // B, slot % B] = k[0], v[0]
        np.testing.assert_array_equal(np.asarray(got[0]), want_k)
        np.testing.assert_array_equal(np.asarray(got[1]), want_v)
        return
    else:
        def f(kc, vc, k, v, md):  # as in a layer: the written caches feed attention too
            kc, vc = be.write_kv(kc, vc, k, v, md, layer=None)
            q = jnp.ones((1, H, D), jnp.float32)
            return kc, vc, be.attention(q, kc, vc, md, layer=None, sm_scale=0.5)
        f = jax.jit(f, donate_argnums=(0, 1))
        hlo = f.lower(kc[layer], vc[layer], k, v, md).compile().as_text()
        assert not re.search(rf"f32\[(1,)?{N},{B},{K},{D}\]\{{[0-9,]*\}} copy\(", hlo)
        got = tuple(np.asarray(x) for x in f(jnp.asarray(kc[layer]), jnp.asarray(vc[layer]),
                                              k, v, md)[:2])
    want_k, want_v = kc[layer].copy(), vc[layer].copy()
    want_k[slot // B, slot % B], want_v[slot // B, slot % B] = k[0], v[0]
    np.testing.assert_array_equal(got[0], want_k)  # NaN == NaN at the same places
    np.testing.assert_array_equal(got[1], want_v)


@pytest.mark.parametrize("impl", ["native", "online"])
@pytest.mark.parametrize("s_pad", [1, 16])
def test_xla_one_token_step_matches_float64_reference(impl, s_pad):
    # A T_pad = 1 step (the default's smallest bucket): one decode row at long context,
    # no prefill-tile loop in the program; NaN-poisoned unused pages must not leak.
    be = XlaBackend(block_size=16, decode_impl=impl)
    for seq_len in (1, 17, 700):
        batch = random_batch(np.random.default_rng(seq_len), q_lens=[1], seq_lens=[seq_len],
                             num_tokens=1, num_seqs=s_pad, max_blocks_per_seq=64,
                             num_kv_blocks=-(-seq_len // 16) + 9, block_size=16, num_heads=9,
                             num_kv_heads=3, head_dim=64)
        _assert_matches_float64_reference(be, batch)


def test_scan_over_layers_with_cache_carry_matches_per_layer_calls():
    """The lead's pattern: stacked caches as the scan carry, write then attend per layer."""
    b = _batch(poison=False)
    be = XlaBackend(block_size=B)
    md = jax.tree.map(jnp.asarray, be.prepare(CommonAttentionMetadata(**b.common_kwargs())))
    rng = np.random.default_rng(7)
    kc = rng.standard_normal((L, N, B, K, D)).astype(np.float32)
    vc = kc + 1.0
    x = rng.standard_normal((L, T, H, D)).astype(np.float32)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(kc, vc, x, md):
        def body(carry, inp):
            li, xl = inp
            kc, vc = be.write_kv(*carry, xl[:, :K], xl[:, K:2 * K], md, layer=li)
            return (kc, vc), be.attention(xl, kc, vc, md, layer=li, sm_scale=0.3)
        (kc, vc), o = lax.scan(body, (kc, vc), (jnp.arange(L, dtype=jnp.int32), x))
        return o, kc, vc

    o, kc2, vc2 = step(jnp.asarray(kc), jnp.asarray(vc), jnp.asarray(x), md)
    for li in range(L):
        kl, vl = reference_write_kv(kc[li:li + 1], vc[li:li + 1], x[li, :, :K], x[li, :, K:2 * K],
                                    b.slot_mapping, 0, num_real_tokens=b.num_tokens)
        np.testing.assert_array_equal(np.asarray(kc2)[li, 1:], kl[0, 1:])
        np.testing.assert_array_equal(np.asarray(vc2)[li, 1:], vl[0, 1:])
        ref = reference_ragged_paged_attention(
            x[li], kl[0], vl[0], b.query_start_loc, b.seq_lens, b.block_table, b.num_seqs,
            sm_scale=0.3)
        np.testing.assert_allclose(np.asarray(o[li]), ref, atol=2e-5, rtol=2e-5)


def test_bad_shapes_raise():
    be = XlaBackend(block_size=B)
    md = be.prepare(CommonAttentionMetadata(**_batch().common_kwargs()))
    q = jnp.zeros((T, H, D))
    kc = jnp.zeros((N, B, K, D))
    with pytest.raises(ValueError, match="stacked cache"):
        be.attention(q, kc, kc, md, layer=0, sm_scale=1.0)
    with pytest.raises(ValueError, match="does not fit"):
        be.attention(jnp.zeros((T, 5, D)), kc, kc, md, layer=None, sm_scale=1.0)


@pytest.mark.parametrize("chunk", [16, 32])
@pytest.mark.parametrize("mulsum", [True, False])
def test_xla_split_kv_decode_many_items_per_row(chunk, mulsum):
    # The previous decode path (decode_impl="split_kv", kept for same-process A/B).
    # Small KV chunks give rows of 1..8 split-KV work items (ragged, with padded slots and
    # poisoned unused pages), so the item walk and the per-row merge are both exercised.
    bs, p, s_pad = 16, 8, 8
    be = XlaBackend(block_size=bs, decode_chunk=chunk, decode_mulsum=mulsum,
                    decode_impl="split_kv")
    q_lens, seq_lens = [1] * 6, [1, 15, 16, 17, 100, 128]
    batch = random_batch(np.random.default_rng(3), q_lens=q_lens, seq_lens=seq_lens, num_tokens=8,
                         num_seqs=s_pad, max_blocks_per_seq=p, num_kv_blocks=72, block_size=bs,
                         num_heads=H, num_kv_heads=K, head_dim=D)
    _assert_matches_float64_reference(be, batch)


def _assert_matches_float64_reference(be, batch, *, stacked=False, want_custom_call=None):
    """be.attention on the (NaN-poisoned) batch: real rows finite and equal to the float64
    reference, padding rows exactly 0. stacked: the cache as layer 1 of a stacked
    [2, N, B, K, D] one whose layer 0 is all NaN (else one layer's cache, layer=None).
    want_custom_call: assert whether the lowered program calls the native kernel."""
    md = jax.tree.map(jnp.asarray, be.prepare(CommonAttentionMetadata(**batch.common_kwargs())))
    d = batch.q.shape[-1]
    kc, vc, layer = jnp.asarray(batch.k_cache), jnp.asarray(batch.v_cache), None
    if stacked:
        kc, vc = (jnp.stack([jnp.full_like(c, jnp.nan), c]) for c in (kc, vc))
        layer = jnp.int32(1)
    fn = jax.jit(functools.partial(be.attention, sm_scale=d ** -0.5))
    if want_custom_call is not None:
        text = fn.lower(jnp.asarray(batch.q), kc, vc, md, layer=layer).as_text()
        assert (native_cpu.TARGET in text) == want_custom_call
    out = np.asarray(fn(jnp.asarray(batch.q), kc, vc, md, layer=layer))
    ref = reference_ragged_paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens,
        batch.block_table, batch.num_seqs, sm_scale=d ** -0.5)
    n = batch.num_tokens
    assert np.isfinite(out[:n]).all()
    np.testing.assert_allclose(out[:n], ref[:n], atol=1e-5, rtol=1e-5)
    assert np.all(out[n:] == 0.0)


def _decode_case(name):
    """(q_lens, seq_lens, T_pad, S_pad, pages per seq) of the item-bound test's mixes."""
    if name == "64_rows_long":  # 64 decode rows, ragged contexts up to 1024 keys
        seq_lens = np.random.default_rng(5).integers(1, 1025, 64).tolist()
        return [1] * 64, seq_lens, 64, 64, 64
    q_lens, seq_lens = named_mixes(16, 200)[name]
    return q_lens, seq_lens, 64, 8, 13


@pytest.mark.parametrize("max_items", [1 << 30, 16, 2], ids=["W=S", "W<=16", "W<=2"])
@pytest.mark.parametrize("case", ["decode_only", "mixed", "64_rows_long"])
def test_xla_decode_item_bounds_match_float64_reference(max_items, case):
    # Items per loop iteration equal to and below S_pad: NaN-poisoned pages and padding
    # rows must not leak, every row's items must merge once (float64 reference).
    q_lens, seq_lens, t_pad, s_pad, p = _decode_case(case)
    be = XlaBackend(block_size=16, decode_max_items=max_items, decode_impl="online")
    batch = random_batch(np.random.default_rng(7), q_lens=q_lens, seq_lens=seq_lens,
                         num_tokens=t_pad, num_seqs=s_pad, max_blocks_per_seq=p,
                         num_kv_blocks=s_pad * p + 1, block_size=16, num_heads=H,
                         num_kv_heads=K, head_dim=D)
    _assert_matches_float64_reference(be, batch)


def _engine_layout_case(name):
    """(q_lens, seq_lens, T_pad, S_pad, pages per seq) in the engine's stack layout: the
    stack's seq dimension is the largest seq bucket and block tables are max_model_len
    wide, so most slots and most block-table columns are padding."""
    rng = np.random.default_rng(11)
    if name == "decode_only":  # ragged decodes, one alone at long context
        return [1] * 5, [1, 15, 17, 300, 2048], 8, 16, 128
    if name == "mixed":  # decodes beside a chunked prefill and a fresh prompt
        return [1, 40, 1, 1, 23], [700, 40 + 90, 1, 33, 23], 128, 16, 128
    if name == "64_rows_long":  # 64 decode rows, contexts up to 2048
        return [1] * 64, rng.integers(1, 2049, 64).tolist(), 64, 64, 128
    raise KeyError(name)


@pytest.mark.parametrize("product", ["blockdiag", "heads", "mulsum"])
@pytest.mark.parametrize("case", ["decode_only", "mixed", "64_rows_long"])
def test_xla_online_decode_matches_float64_reference(product, case):
    # The per-row online merge of split-KV items (decode_impl="online"), each product
    # form, against the float64 reference: NaN-poisoned unused pages, padding rows and
    # padded slots must not leak, and every item must be merged into its row exactly once.
    q_lens, seq_lens, t_pad, s_pad, p = _engine_layout_case(case)
    need = sum(-(-s // 16) for s in seq_lens)
    be = XlaBackend(block_size=16, decode_impl="online", decode_product=product)
    batch = random_batch(np.random.default_rng(13), q_lens=q_lens, seq_lens=seq_lens,
                         num_tokens=t_pad, num_seqs=s_pad, max_blocks_per_seq=p,
                         num_kv_blocks=need + 9, block_size=16, num_heads=H, num_kv_heads=K,
                         head_dim=D)
    _assert_matches_float64_reference(be, batch)


@pytest.mark.parametrize("heads", [(H, K, D), (9, 3, 64)], ids=["tiny", "smollm2"])
@pytest.mark.parametrize("chunk_pages", [1, 16])
@pytest.mark.parametrize("stacked", [False, True], ids=["per_layer", "stacked"])
@pytest.mark.parametrize("case", ["decode_only", "mixed", "64_rows_long"])
def test_xla_native_decode_matches_float64_reference(case, stacked, chunk_pages, heads):
    # The native FFI decode kernel (decode_impl="native", the CPU default): decode-only,
    # mixed (decodes beside prefill tiles on the jnp path) and 64 rows up to 2048 keys, in
    # the engine layout. NaN-poisoned unused slots and pages (and, stacked, a NaN layer 0)
    # must not leak; 1-page tasks split long rows into many partials to merge; the
    # SmolLM2 geometry runs the kernel's specialised (D 64, G 3, K 3) body.
    assert native_cpu.available(), native_cpu.unavailable_reason()
    h, kh, d = heads
    q_lens, seq_lens, t_pad, s_pad, p = _engine_layout_case(case)
    need = sum(-(-s // 16) for s in seq_lens)
    be = XlaBackend(block_size=16, native_chunk_pages=chunk_pages)
    batch = random_batch(np.random.default_rng(17), q_lens=q_lens, seq_lens=seq_lens,
                         num_tokens=t_pad, num_seqs=s_pad, max_blocks_per_seq=p,
                         num_kv_blocks=need + 9, block_size=16, num_heads=h, num_kv_heads=kh,
                         head_dim=d)
    _assert_matches_float64_reference(be, batch, stacked=stacked, want_custom_call=True)


def test_xla_native_decode_bf16_target_and_online_fallback():
    # decode_impl="online" keeps the jnp path (no custom call); bf16 caches (issue 26's
    # --kv_cache_dtype) go to the kernel's bf16 target, not the f32 one.
    q_lens, seq_lens, t_pad, s_pad, p = _engine_layout_case("decode_only")
    batch = random_batch(np.random.default_rng(19), q_lens=q_lens, seq_lens=seq_lens,
                         num_tokens=t_pad, num_seqs=s_pad, max_blocks_per_seq=p,
                         num_kv_blocks=200, block_size=16, num_heads=H, num_kv_heads=K,
                         head_dim=D)
    _assert_matches_float64_reference(XlaBackend(block_size=16, decode_impl="online"), batch,
                                      want_custom_call=False)
    be = XlaBackend(block_size=16)
    md = jax.tree.map(jnp.asarray, be.prepare(CommonAttentionMetadata(**batch.common_kwargs())))
    kc = jnp.asarray(np.nan_to_num(batch.k_cache), jnp.bfloat16)
    text = jax.jit(functools.partial(be.attention, layer=None, sm_scale=0.3)).lower(
        jnp.asarray(batch.q, jnp.bfloat16), kc, kc, md).as_text()
    assert native_cpu.TARGET not in text
    assert native_cpu.TARGETS["bfloat16"][0] in text


def test_native_paged_decode_rejects_out_of_range_pages_and_layer():
    # A used page id outside the pool, or a layer outside the stack, fails the call with
    # a message naming the value instead of reading out of bounds.
    q = jnp.ones((2, K, H // K, D))
    kc = jnp.zeros((1, 5, B, K, D))
    kv_len = jnp.asarray([3, 0], jnp.int32)
    ok = native_cpu.paged_decode(q, kv_len, jnp.asarray([[4], [99]], jnp.int32), kc, kc, 0,
                                 sm_scale=1.0, chunk_pages=1)  # slot 1 is unused: 99 unread
    assert np.all(np.asarray(ok) == 0.0)
    with pytest.raises(Exception, match="page 7 of slot 0 not in"):
        native_cpu.paged_decode(q, kv_len, jnp.asarray([[7], [0]], jnp.int32), kc, kc, 0,
                                sm_scale=1.0, chunk_pages=1).block_until_ready()
    with pytest.raises(Exception, match="layer 1 not in"):
        native_cpu.paged_decode(q, kv_len, jnp.asarray([[1], [0]], jnp.int32), kc, kc, 1,
                                sm_scale=1.0, chunk_pages=1).block_until_ready()
    with pytest.raises(Exception, match=r"kv_len\[0\]=17 not in"):
        native_cpu.paged_decode(q, jnp.asarray([17, 0], jnp.int32),
                                jnp.asarray([[1], [0]], jnp.int32), kc, kc, 0,
                                sm_scale=1.0, chunk_pages=1).block_until_ready()


def test_online_softmax_merge_into_equals_one_softmax():
    # Items of one row split across batches and repeated within a batch, plus an empty
    # item, merged with merge_into: equal to one softmax over all of the row's keys.
    from jaxserve.attention.kernels.online_softmax import init_state, merge_into, normalize, \
        online_softmax_step

    rng = np.random.default_rng(0)
    rows, d, ck = 3, 4, 5
    scores = rng.standard_normal((rows, 4, ck)) * 4  # 4 chunks per row
    vals = rng.standard_normal((rows, 4, ck, d))
    state = init_state((rows + 1,), d)
    order = [(0, 0), (0, 1), (2, 3), (1, 0), (0, 2), (2, 0), (2, 1), (1, 1), (1, 2), (2, 2),
             (1, 3), (0, 3)]
    for b in range(0, len(order), 4):  # batches of 4 items, rows repeat inside a batch
        idx = order[b:b + 4]
        s = jnp.asarray(np.stack([scores[r, c] for r, c in idx]), jnp.float32)
        v = jnp.asarray(np.stack([vals[r, c] for r, c in idx]), jnp.float32)
        part = online_softmax_step(init_state((len(idx),), d), s, jnp.ones_like(s, bool),
                                   lambda p, v=v: jnp.einsum("wc,wcd->wd", p, v))
        state = merge_into(state, jnp.asarray([r for r, _ in idx], jnp.int32), part)
    empty = init_state((1,), d)  # an item with no valid key changes nothing
    state = merge_into(state, jnp.asarray([1], jnp.int32), empty)
    out = np.asarray(normalize(state[0], state[2]))
    for r in range(rows):
        s, v = scores[r].reshape(-1), vals[r].reshape(-1, d)
        p = np.exp(s - s.max())
        np.testing.assert_allclose(out[r], p @ v / p.sum(), rtol=1e-5, atol=1e-6)
    assert np.all(out[rows] == 0.0)  # the sink row saw nothing


@pytest.mark.parametrize("bad,match", [(dict(decode_impl="fast"), "decode_impl='fast'"),
                                       (dict(decode_product="dot"), "decode_product='dot'"),
                                       (dict(decode_max_items=0), "decode_max_items=0"),
                                       (dict(native_chunk_pages=0), "native_chunk_pages=0")])
def test_xla_backend_rejects_bad_settings(bad, match):
    with pytest.raises(ValueError, match=match):
        XlaBackend(block_size=16, **bad)
