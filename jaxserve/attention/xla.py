"""The "xla" attention backend: ragged paged attention in jnp (the CPU default).

On CPU with f32, f16 or bf16 caches, decode rows go to a native XLA FFI kernel
(`native_cpu.paged_decode`, `decode_impl="native"`): it reads each slot's pages in
place on both cores, 2-7x faster per layer than the jnp decode path below, which
stays for other platforms, other dtypes, a missing C++ compiler, and A/B
(notes/perf.md, helper "attn"). In the jnp path, decode rows (q_len = 1) are split
into (sequence, KV chunk) work items walked W at a time; each iteration folds
its items' softmax partials into per-row running states (split-KV,
flash-decoding, Dao et al. 2023), so the cost follows the sum of the real
context lengths: padded slots, short rows beside a long one and unused
block-table columns cost nothing. Prefill rows run tile by tile
in a loop whose trip count is the number of tiles in use, each walking its
pages in chunks with an online softmax (FlashAttention-2, Dao 2023) up to its
own causal end. Both read the stacked cache [L, N, B, K, D] at a traced
`layer` inside their gather, so a `lax.scan` over layers can carry the cache
and update it in place (notes/attention.md). The float64 reference it is
tested against is `reference.reference_ragged_paged_attention`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxserve.attention.common import (CommonAttentionMetadata, check_q_fits, host_common,
                                             num_query_tiles, query_tiles, real_q_lens,
                                             sliding_window_start, stacked_cache, window_scalar)
from jaxserve.attention import native_cpu
from jaxserve.attention.kernels.online_softmax import init_state, merge_into, normalize, online_softmax_step


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["slot_mapping", "block_table", "decode_token_idx", "decode_kv_len",
                 "prefill_tile_seq", "prefill_tile_q_start", "prefill_tile_pos0",
                 "prefill_tile_kv_end", "prefill_num_tiles"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class XlaMetadata:
    """The xla path's step metadata. T = T_pad, S = S_pad, NP the static prefill tile bound."""

    slot_mapping: np.ndarray  # i32[T] page * B + offset; padding -> block 0
    block_table: np.ndarray  # i32[S, P]
    # Decode rows: sequence s is a decode iff q_len[s] == 1.
    decode_token_idx: np.ndarray  # i32[S] its flat token index, T when not a decode
    decode_kv_len: np.ndarray  # i32[S] its seq_len, 0 when not a decode
    # Prefill tiles (sequences with q_len >= 2), block_q tokens each.
    prefill_tile_seq: np.ndarray  # i32[NP]
    prefill_tile_q_start: np.ndarray  # i32[NP] flat index of the tile's first token
    prefill_tile_pos0: np.ndarray  # i32[NP] absolute position of the first token
    prefill_tile_kv_end: np.ndarray  # i32[NP] 1 + position of the last real token
    prefill_num_tiles: np.ndarray  # i32[1] tiles in use


def write_one_row(k_cache, v_cache, k, v, idx):
    """The T = 1 KV write: k, v [1, K, D] at cache index idx (leading indices of the
    [..., B, K, D] caches, i32 scalars), as one dynamic-update-slice per cache.

    XLA rewrites a one-row scatter into a bounds-checked select + update that it
    duplicates for each user of the cache (the attention and the output), copying the
    layer cache ~5 times per call: 31-40 ms per layer at 728 blocks, against 4.7 ms for
    the 8-row program. The optimization barrier keeps the one in-place update. The slot
    comes from the block manager's block table (padding: the null block 0), so it is in
    range; unlike the scatter, which drops an out-of-range row, the update would clamp
    one into the last slot.
    """
    z = jnp.zeros((), jnp.int32)
    at = (*idx, z, z)
    row = (1,) * len(idx) + k.shape[1:]  # the update's shape: [1, ..., 1, K, D]
    k_cache = lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype).reshape(row), at)
    v_cache = lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype).reshape(row), at)
    return lax.optimization_barrier((k_cache, v_cache))


def write_kv_xla(k_cache, v_cache, k, v, slot_mapping, layer):
    """Scatter k, v [T, K, D] into layer `layer` of k_cache, v_cache [L, N, B, K, D].

    One scatter per cache on the whole stacked array (no per-layer slice copy), so
    XLA updates the donated / carried buffer in place. Padding tokens point into
    the null block 0 and may collide there, which is harmless since block 0 is
    never read as a real key.
    """
    bs = k_cache.shape[2]
    blk, off = slot_mapping // bs, slot_mapping % bs  # [T]
    k_cache = k_cache.at[layer, blk, off].set(k.astype(k_cache.dtype))
    v_cache = v_cache.at[layer, blk, off].set(v.astype(v_cache.dtype))
    return k_cache, v_cache


@dataclasses.dataclass(frozen=True)
class XlaBackend:
    """Ragged paged attention in jnp. Tiling chosen by measurement (notes/attention.md, perf.md).

    Args:
      block_size: B, tokens per KV page.
      block_q: tokens per prefill tile.
      decode_chunk: keys per split-KV work item of the decode rows.
      decode_mulsum: (decode_impl="split_kv" only) products as multiply + sum.
      decode_max_items: at most this many split-KV items per loop iteration.
      prefill_chunk: keys per inner step of a prefill tile.
      decode_impl: "native" (default: the XLA:CPU FFI kernel of `native_cpu`, which
        reads each slot's pages in place on both cores; used when tracing for CPU with
        f32 caches and the kernel builds, else "online"), "online" (each loop iteration
        folds its items into per-row states, `_decode_online`) or "split_kv" (the
        older path: per-item buffers sized S x max_blocks_per_seq, merged after the
        loop). The last two stay for same-process A/B in scripts/profile_step.py.
      native_chunk_pages: pages per (slot, chunk) task of the native kernel.
      decode_product: "blockdiag" | "heads" | "mulsum", the online path's products
        (`_decode_products`). Measured in notes/perf.md (2026-12-01, helper "perf").
    """

    block_size: int
    block_q: int = 32
    decode_chunk: int = 128
    decode_mulsum: bool = True
    decode_max_items: int = 8
    prefill_chunk: int = 256
    decode_impl: str = "native"
    native_chunk_pages: int = 16
    decode_product: str = "blockdiag"
    name: str = "xla"

    def __post_init__(self):
        if self.decode_impl not in ("native", "online", "split_kv"):
            raise ValueError(f"decode_impl={self.decode_impl!r} must be 'native', 'online' "
                             f"or 'split_kv'")
        if self.decode_product not in ("blockdiag", "heads", "mulsum"):
            raise ValueError(f"decode_product={self.decode_product!r} must be 'blockdiag', "
                             f"'heads' or 'mulsum'")
        for f in ("block_size", "block_q", "decode_chunk", "decode_max_items", "prefill_chunk",
                  "native_chunk_pages"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f}={getattr(self, f)} must be > 0")
        if self.decode_impl == "native" and jax.default_backend() == "cpu":
            # Build and register the FFI target now, before any program that calls it is
            # loaded from the executable cache (a cache hit traces nothing).
            native_cpu.available()

    def prepare(self, common: CommonAttentionMetadata) -> XlaMetadata:
        """Validate the step and tile its prefill rows (host, vectorized NumPy).

        Raises:
          ValueError: see `host_common`.
        """
        c = host_common(common, self.block_size)
        t, s = c.slot_mapping.shape[0], c.seq_lens.shape[0]
        q_lens = real_q_lens(c)
        decode = q_lens == 1
        pre = query_tiles(c.query_start_loc, c.seq_lens, np.where(q_lens >= 2, q_lens, 0),
                          self.block_q, num_query_tiles(t, min(s, t // 2), self.block_q))
        return XlaMetadata(
            slot_mapping=c.slot_mapping, block_table=c.block_table,
            decode_token_idx=np.where(decode, c.query_start_loc[:-1], t).astype(np.int32),
            decode_kv_len=np.where(decode, c.seq_lens, 0).astype(np.int32),
            prefill_tile_seq=pre["tile_seq"], prefill_tile_q_start=pre["tile_q_start"],
            prefill_tile_pos0=pre["tile_pos0"], prefill_tile_kv_end=pre["tile_kv_end"],
            prefill_num_tiles=pre["num_tiles"])

    def write_kv(self, k_cache, v_cache, k, v, md: XlaMetadata, *, layer):
        """See `AttentionBackend.write_kv`: one XLA scatter per cache (at T = 1 one
        dynamic-update-slice, `write_one_row`)."""
        kc, vc, li, one_layer = stacked_cache(k_cache, v_cache, layer)  # checks the ranks
        if k.shape[0] == 1:  # on the caches as passed: a one-layer cache's [None] view
            slot = md.slot_mapping[0]  # fused into the update, made XLA copy the cache too
            at = (slot // self.block_size, slot % self.block_size)
            return write_one_row(k_cache, v_cache, k, v, at if one_layer else (li, *at))
        kc, vc = write_kv_xla(kc, vc, k, v, md.slot_mapping, li)
        return (kc[0], vc[0]) if one_layer else (kc, vc)

    def attention(self, q, k_cache, v_cache, md: XlaMetadata, *, layer, sm_scale: float,
                  sliding_window=None):
        """See `AttentionBackend.attention`. Raises ValueError when q does not fit the cache."""
        kc, vc, li, _ = stacked_cache(k_cache, v_cache, layer)
        check_q_fits(q, kc, self.block_size)
        return _xla_attention(self, q, kc, vc, li, md, float(sm_scale),
                              window_scalar(sliding_window))


def _gather_pages(cache, layer, pg):
    """Pages pg (i32[n, cp]) of layer `layer` of cache [L, N, B, K, D] -> [n, cp*B, K, D].

    A row gather on the free [L*N, B*K*D] view: one contiguous page per index, which
    XLA:CPU copies ~1.5x faster than the 5-D gather (notes/perf.md).
    """
    nl, nb, bs, kh, d = cache.shape
    rows = cache.reshape(nl * nb, bs * kh * d).at[pg + layer * nb].get(mode="promise_in_bounds")
    return rows.reshape(pg.shape[0], pg.shape[1] * bs, kh, d)


def _flash_chunks(q, row_pos, kv_end, pages, kc, vc, layer, *, sm_scale, chunk_pages, n_chunks,
                  window, kv_start=0, c0=0):
    """Online-softmax attention of tiles of rows against their sequences' pages.

    q: [n, K, M, D] (M rows per KV head: tokens x heads-in-group); row_pos: i32[n, M]
    position of each row; kv_end: i32[n] keys in use per tile; pages: i32[n, P'] page
    ids (P' a multiple of chunk_pages); kc, vc: [L, N, B, K, D]; n_chunks: traced end
    of the chunk loop, c0 its start (chunks wholly before every row's window are
    skipped); window: i32[] keys a row sees (itself included, `sliding_window_start`);
    kv_start: i32[n] the first key any row of the tile sees. Returns f32[n, K, M, D].
    (Prefill tiles; decode rows use `_decode_online`.)
    """
    n, kh, m, d = q.shape
    ck = chunk_pages * kc.shape[2]
    j = jnp.arange(ck, dtype=jnp.int32)
    dt = jnp.promote_types(jnp.promote_types(kc.dtype, vc.dtype), q.dtype)

    def body(c, state):
        pg = lax.dynamic_slice_in_dim(pages, c * chunk_pages, chunk_pages, axis=1)  # [n, cp]
        # Gather straight from the stacked cache at `layer` (no per-layer copy); a 16-bit
        # cache (--kv_cache_dtype) is upcast after the gather (bf16 + f16 -> f32).
        k = _gather_pages(kc, layer, pg).astype(dt)  # [n, CK, K, D]
        v = _gather_pages(vc, layer, pg).astype(dt)
        kpos = c * ck + j  # [CK]
        key_ok = (kpos[None, :] < kv_end[:, None]) & (kpos[None, :] >= kv_start)  # [n, CK]
        valid = ((kpos[None, None, :] <= row_pos[:, :, None])
                 & (kpos[None, None, :] > row_pos[:, :, None] - window)
                 & key_ok[:, None, :])[:, None]  # [n, 1, M, CK]
        v = jnp.where(key_ok[:, :, None, None], v, jnp.zeros_like(v))  # 0 * NaN would leak
        # K before the key axis, so both dots are plain batched matmuls.
        k = k.transpose(0, 2, 1, 3)  # [n, K, CK, D]
        v = v.transpose(0, 2, 1, 3)
        s = jnp.einsum("nkmd,nkcd->nkmc", q, k, preferred_element_type=jnp.float32) * sm_scale
        return online_softmax_step(state, s, valid, lambda p: jnp.einsum(
            "nkmc,nkcd->nkmd", p.astype(v.dtype), v, preferred_element_type=jnp.float32))

    acc, _, l_sum = lax.fori_loop(c0, n_chunks, body, init_state((n, kh, m), d))
    return normalize(acc, l_sum)


def _decode_scores(q, k, v, sm_scale, multiply_sum):
    """Scores f32[W, K, G, CK] and the p -> p.v function of one batch of decode items."""
    k, v = k.astype(jnp.float32), v.astype(jnp.float32)  # a 16-bit cache: f32 math
    if multiply_sum:
        s = jnp.sum(q[:, None] * k[:, :, :, None, :].astype(jnp.float32), -1)  # [W, CK, K, G]
        s = s.transpose(0, 2, 3, 1) * sm_scale  # [W, K, G, CK]
        return s, lambda p: jnp.sum(
            p.transpose(0, 3, 1, 2)[..., None] * v[:, :, :, None, :].astype(jnp.float32), 1)
    s = jnp.einsum("wkgd,wckd->wkgc", q, k, preferred_element_type=jnp.float32) * sm_scale
    return s, lambda p: jnp.einsum("wkgc,wckd->wkgd", p, v.astype(jnp.float32),
                                   preferred_element_type=jnp.float32)


def _decode_split_kv(q, kv_len, pages, kc, vc, layer, *, sm_scale, chunk_pages, multiply_sum,
                     max_items, window):
    """Decode attention over a flat list of (sequence, KV chunk) work items (split-KV).

    Flash-decoding style (Dao et al. 2023): sequence s contributes ceil(kv_len[s] / CK)
    items; each loop iteration takes the next S items, whatever sequences they belong to,
    and the per-item partial softmax states are merged per sequence at the end. The cost
    follows the sum of the real context lengths, not S_pad x the longest one: padded
    slots (kv_len 0) and short rows next to a long one cost nothing.

    q: [S, K, G, D]; kv_len: i32[S] (0 = not a decode); pages: i32[S, P'] (P' a multiple
    of chunk_pages); each iteration takes W = min(S, max_items) items: in large
    buckets the multiply-reduce products cost superlinearly in W (64 rows x 1024 keys:
    46.5 ms per layer at W = 64 vs 28.0 at W = 8, notes/perf.md), so they walk more,
    smaller iterations.
    Returns f32[S, K, G, D], 0 for rows with kv_len 0.
    """
    n, kh, g, d = q.shape
    w = min(n, max_items)
    ck = chunk_pages * kc.shape[2]
    n_iter_max = -(-n * (pages.shape[1] // chunk_pages) // w)  # ceil(S * chunks per row / W)
    lo, first, cnt = _window_items(kv_len, window, ck)  # [S] each
    end = jnp.cumsum(cnt)  # [S] exclusive end of each sequence's items
    start = end - cnt
    total = end[-1]
    j = jnp.arange(ck, dtype=jnp.int32)
    cols = jnp.arange(chunk_pages, dtype=jnp.int32)

    def item_rows(idx):  # flat item ids -> (row, chunk, valid)
        row = jnp.minimum(jnp.sum(idx[:, None] >= end[None, :], -1), n - 1)
        return row, idx - start[row] + first[row], idx < total

    def body(it, bufs):
        idx = it * w + jnp.arange(w, dtype=jnp.int32)  # [W] items of this iteration
        row, chunk, ok = item_rows(idx)
        pg = pages[row[:, None], chunk[:, None] * chunk_pages + cols[None, :]]  # [W, cp]
        pg = jnp.where(ok[:, None], pg, 0)
        kpos = chunk[:, None] * ck + j[None, :]  # [W, CK]
        key_ok = (kpos < kv_len[row][:, None]) & (kpos >= lo[row][:, None]) & ok[:, None]
        k = _gather_pages(kc, layer, pg)  # [W, CK, K, D]
        v = _gather_pages(vc, layer, pg)
        v = jnp.where(key_ok[:, :, None, None], v, jnp.zeros_like(v))  # 0 * NaN would leak
        s, pv = _decode_scores(q[row].astype(jnp.float32), k, v, sm_scale, multiply_sum)
        # Each item's partial state starts empty; the merge below combines them.
        part = online_softmax_step(init_state((w, kh, g), d), s, key_ok[:, None, None, :], pv)
        return tuple(lax.dynamic_update_slice_in_dim(b, x, it * w, 0) for b, x in zip(bufs, part))

    nb = n_iter_max * w
    acc_buf, m_buf, l_buf = lax.fori_loop(0, (total + w - 1) // w, body, init_state((nb, kh, g), d))
    # Merge the partial states per sequence; unused slots go to the extra segment n.
    row, _, ok = item_rows(jnp.arange(nb, dtype=jnp.int32))
    seg = jnp.where(ok, row, n)
    m_row = jax.ops.segment_max(m_buf, seg, num_segments=n + 1)  # [S+1, K, G]
    w = jnp.where(ok[:, None, None], jnp.exp(m_buf - m_row[seg]), 0.0)  # [NB, K, G]
    l_row = jax.ops.segment_sum(l_buf * w, seg, num_segments=n + 1)[:n]
    acc = jax.ops.segment_sum(acc_buf * w[..., None], seg, num_segments=n + 1)[:n]
    return normalize(acc, l_row)


def _window_items(kv_len, window, ck):
    """(lo, first, cnt), each i32[S], of decode rows with kv_len keys under a sliding
    window: the first key a row sees (kv_len - window, at least 0), the first chunk of
    ck keys holding it, and the chunks from there to the row's end (0 for kv_len 0)."""
    lo = jnp.maximum(kv_len - window, 0)
    first = lo // ck
    cnt = jnp.where(kv_len > 0, (kv_len + ck - 1) // ck - first, 0)
    return lo, first, cnt


def _decode_products(q, k, v, sm_scale, product):
    """Scores and the p -> p.v function of one batch of W decode items.

    q: f32[W, K, G, D]; k, v: [W, CK, K, D] (v zeroed at invalid keys).
    product: "blockdiag" (q as a block-diagonal [K*G, K*D] matrix per item, so both
    products are plain batched matmuls on the gathered [CK, K*D] rows: no transpose of
    K or V, at K x the flops), "heads" (one [G, D] x [D, CK] matmul per KV head), or
    "mulsum" (broadcast multiply + sum).
    Returns (s f32[W, K, G, CK], pv: f32[W, K, G, CK] -> f32[W, K, G, D]).
    """
    if product != "blockdiag":
        return _decode_scores(q, k, v, sm_scale, product == "mulsum")
    w, ck, kh, d = k.shape
    g = q.shape[2]
    eye = jnp.eye(kh, dtype=jnp.float32)
    qbd = jnp.einsum("wkgd,kj->wkgjd", q, eye).reshape(w, kh * g, kh * d)
    kf = k.reshape(w, ck, kh * d).astype(jnp.float32)
    vf = v.reshape(w, ck, kh * d).astype(jnp.float32)
    s = jnp.einsum("wmf,wcf->wmc", qbd, kf, preferred_element_type=jnp.float32)

    def pv(p):
        o = jnp.einsum("wmc,wcf->wmf", p.reshape(w, kh * g, ck), vf,
                       preferred_element_type=jnp.float32)
        return jnp.einsum("wkgjd,kj->wkgd", o.reshape(w, kh, g, kh, d), eye)
    return s.reshape(w, kh, g, ck) * sm_scale, pv


def _decode_online(q, kv_len, pages, kc, vc, layer, *, sm_scale, chunk_pages, max_items,
                   product, window):
    """Decode attention over (sequence, KV chunk) work items, merged into per-row states.

    Split-KV as in flash-decoding (Dao et al. 2023): sequence s contributes
    ceil(kv_len[s] / CK) items of CK = chunk_pages * B keys; each loop iteration takes
    the next W = min(S, max_items) items, whatever sequences they belong to, gathers
    their pages once (rows of the free [L*N, B*K*D] view), and folds each item's
    softmax partial into its row's running state (`online_softmax.merge_into`). The
    loop runs ceil(sum(items) / W) times, so the cost follows the real KV bytes; no
    buffer scales with S x max_blocks_per_seq.

    q: [S, K, G, D]; kv_len: i32[S] (0 = not a decode row); pages: i32[S, P'] (P' a
    multiple of chunk_pages); window: i32[] keys a row sees (its last `window` ones; chunks
    wholly before them are no items). Returns f32[S, K, G, D], 0 for rows with kv_len 0.
    """
    n, kh, g, d = q.shape
    w = min(n, max_items)
    ck = chunk_pages * kc.shape[2]
    lo, first, cnt = _window_items(kv_len, window, ck)  # [S] each
    end = jnp.cumsum(cnt)
    start = end - cnt
    total = end[-1]
    q = q.astype(jnp.float32)
    j = jnp.arange(ck, dtype=jnp.int32)
    cols = jnp.arange(chunk_pages, dtype=jnp.int32)

    def body(it, state):
        idx = it * w + jnp.arange(w, dtype=jnp.int32)  # [W] items of this iteration
        ok = idx < total
        row = jnp.minimum(jnp.sum(idx[:, None] >= end[None, :], -1), n - 1)
        chunk = idx - start[row] + first[row]
        pg = jnp.where(ok[:, None], pages[row[:, None], chunk[:, None] * chunk_pages + cols], 0)
        kpos = chunk[:, None] * ck + j  # [W, CK]
        key_ok = (kpos < kv_len[row][:, None]) & (kpos >= lo[row][:, None]) & ok[:, None]
        k = _gather_pages(kc, layer, pg)  # [W, CK, K, D]
        v = _gather_pages(vc, layer, pg)
        v = jnp.where(key_ok[:, :, None, None], v, jnp.zeros_like(v))  # 0 * NaN would leak
        s, pv = _decode_products(q[row], k, v, sm_scale, product)
        part = online_softmax_step(init_state((w, kh, g), d), s, key_ok[:, None, None, :], pv)
        return merge_into(state, jnp.where(ok, row, n), part)  # row n: a sink for unused items

    acc, _, l_sum = lax.fori_loop(0, (total + w - 1) // w, body, init_state((n + 1, kh, g), d))
    return normalize(acc[:n], l_sum[:n])


def _use_native(kc, vc) -> bool:
    """Whether the native kernel can serve this trace: CPU, f32 / f16 / bf16 caches of one
    dtype, and it builds."""
    return (jax.default_backend() == "cpu" and kc.dtype == vc.dtype
            and jnp.dtype(kc.dtype).name in native_cpu.CACHE_DTYPES and native_cpu.available())


def _pad_pages(block_table, chunk_pages):
    return jnp.pad(block_table, ((0, 0), (0, -block_table.shape[1] % chunk_pages)))


def _xla_attention(be: XlaBackend, q, kc, vc, layer, md: XlaMetadata, sm_scale: float, window):
    t, h, d = q.shape
    kh = kc.shape[3]
    g = h // kh
    bs = kc.shape[2]
    bq = be.block_q
    # One zero row at index T (target of non-decode slots) and bq rows of tile overhang.
    qg = jnp.pad(q.reshape(t, kh, g, d), ((0, bq), (0, 0), (0, 0), (0, 0)))
    out = jnp.zeros((t + bq, kh, g, d), jnp.float32)

    # Decode rows: one query per sequence slot, all slots batched.
    dcp = max(1, be.decode_chunk // bs)
    dq = qg[md.decode_token_idx]  # [S, K, G, D]
    if be.decode_impl == "native" and _use_native(kc, vc):
        o_dec = native_cpu.paged_decode(dq, md.decode_kv_len, md.block_table, kc, vc, layer,
                                        sm_scale=sm_scale, chunk_pages=be.native_chunk_pages,
                                        window=window)
    elif be.decode_impl in ("native", "online"):
        o_dec = _decode_online(dq, md.decode_kv_len, _pad_pages(md.block_table, dcp), kc, vc,
                               layer, sm_scale=sm_scale, chunk_pages=dcp,
                               max_items=be.decode_max_items, product=be.decode_product,
                               window=window)
    else:
        o_dec = _decode_split_kv(dq, md.decode_kv_len, _pad_pages(md.block_table, dcp), kc, vc,
                                 layer, sm_scale=sm_scale, chunk_pages=dcp,
                                 multiply_sum=be.decode_mulsum,
                                 max_items=be.decode_max_items, window=window)  # [S, K, G, D]
    out = out.at[md.decode_token_idx].set(o_dec)

    # Prefill tiles, one at a time, each up to its own causal end.
    pcp = max(1, be.prefill_chunk // bs)
    pages = _pad_pages(md.block_table, pcp)

    def tile(i, out):
        q_start, kv_end = md.prefill_tile_q_start[i], md.prefill_tile_kv_end[i]
        pos = md.prefill_tile_pos0[i] + jnp.arange(bq, dtype=jnp.int32)  # [bq]
        qt = lax.dynamic_slice_in_dim(qg, q_start, bq)  # [bq, K, G, D]
        qt = qt.transpose(1, 0, 2, 3).reshape(1, kh, bq * g, d)  # rows m = token * G + head
        kv_start = sliding_window_start(md.prefill_tile_pos0[i], window)
        ot = _flash_chunks(qt, jnp.repeat(pos, g)[None], kv_end[None],
                           pages[md.prefill_tile_seq[i]][None], kc, vc, layer,
                           sm_scale=sm_scale, chunk_pages=pcp,
                           n_chunks=-(-kv_end // (pcp * bs)), window=window,
                           kv_start=kv_start, c0=kv_start // (pcp * bs))  # [1, K, bq * G, D]
        ot = ot.reshape(kh, bq, g, d).transpose(1, 0, 2, 3)  # [bq, K, G, D]
        old = lax.dynamic_slice_in_dim(out, q_start, bq)
        keep = (pos < kv_end)[:, None, None, None]  # rows past the sequence's end
        return lax.dynamic_update_slice_in_dim(out, jnp.where(keep, ot, old), q_start, 0)

    if t > 1:  # one token is a decode row (q_len 1) or padding: a T = 1 step has no tile
        # (and the loop's use of the caches made XLA copy each layer cache at T = 1).
        out = lax.fori_loop(0, md.prefill_num_tiles[0], tile, out)
    return out[:t].reshape(t, h, d).astype(q.dtype)
