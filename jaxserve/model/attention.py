"""Attention metadata and the backend switch for ragged paged attention.

`make_attention_metadata` turns a step batch (host NumPy, bucket shapes) into an
`AttentionMetadata` pytree; `write_kv` scatters the step's new K/V rows into the
paged cache; `attention` runs ragged paged attention with one of two backends:

* "xla": pure jnp, the CPU default. Decode rows (q_len = 1) are split into
  (sequence, 128-key chunk) work items walked S at a time and merged per
  sequence (split-KV, flash-decoding), so the cost follows the sum of the real
  context lengths: padded slots and short rows beside a long one cost nothing.
  Prefill rows run tile by tile in a loop whose trip count is the number of
  tiles in use, each walking its pages in chunks with an online softmax
  (FlashAttention-2, Dao 2023) up to its own causal end.
* "pallas": the Triton kernel of jaxserve/pallas/ragged_paged_attention.py
  (GPU default; `interpret=True` on CPU for tests).

Both read the stacked cache [L, N, B, K, D] at a traced `layer` inside their
gather / kernel, so a `lax.scan` over layers can carry the cache and update it
in place (see notes/attention.md for the measurement).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxserve.pallas import kv_cache_update as kvu
from jaxserve.pallas import ragged_paged_attention as rpa

Backend = Literal["xla", "pallas"]

# xla path tiling, chosen by measurement (notes/attention.md).
XLA_BLOCK_Q = 32  # tokens per prefill tile
XLA_DECODE_CHUNK = 128  # keys per split-KV work item, decode rows (notes/perf.md)
XLA_DECODE_MULSUM = True  # decode products as multiply + sum instead of tiny matmuls
XLA_PREFILL_CHUNK = 256  # keys per inner step, prefill tiles
PALLAS_CHUNK = 64  # keys per inner step of the Pallas kernel


def default_backend() -> Backend:
    """"pallas" when the default JAX device is a GPU, else "xla"."""
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def choose_pallas_block_q(num_tokens: int, num_seqs: int, num_queries_per_kv: int) -> int:
    """Tokens per Pallas query tile for a (T_pad, S_pad) bucket.

    A tile has block_q * next_pow2(H/K) rows and `tl.dot` needs >= 16 rows.
    Decode-heavy buckets (<= 2 tokens per sequence) take the smallest legal tile
    (few wasted rows); prefill-heavy buckets take 64-row tiles.
    """
    gp = 1 << max(0, num_queries_per_kv - 1).bit_length()
    min_bq = max(1, 16 // gp)
    if num_tokens <= 2 * num_seqs:
        return min_bq
    return max(min_bq, 64 // gp)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["slot_mapping", "query_start_loc", "seq_lens", "block_table", "num_seqs",
                 "decode_token_idx", "decode_kv_len",
                 "prefill_tile_seq", "prefill_tile_q_start", "prefill_tile_pos0",
                 "prefill_tile_kv_end", "prefill_num_tiles",
                 "tile_seq", "tile_q_start", "tile_pos0", "tile_kv_end", "token_out_row"],
    meta_fields=["block_size", "xla_block_q", "pallas_block_q"])
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Per-step attention inputs; NumPy leaves on the host, jax arrays on device.

    T = T_pad tokens, S = S_pad sequences, P = max_blocks_per_seq, NP / NT the
    static tile bounds of the xla prefill loop / the Pallas grid.
    """

    slot_mapping: jax.Array  # i32[T] block_id * B + offset; padding -> block 0
    query_start_loc: jax.Array  # i32[S+1] exclusive prefix sum of q_lens
    seq_lens: jax.Array  # i32[S] KV length after this step; 0 for padded slots
    block_table: jax.Array  # i32[S, P] page ids; padding -> 0 (null block)
    num_seqs: jax.Array  # i32[1] sequences in use
    # xla path, decode rows: sequence s is a decode iff q_len[s] == 1.
    decode_token_idx: jax.Array  # i32[S] its flat token index, T when not a decode
    decode_kv_len: jax.Array  # i32[S] its seq_len, 0 when not a decode
    # xla path, prefill tiles (sequences with q_len >= 2), XLA_BLOCK_Q tokens each.
    prefill_tile_seq: jax.Array  # i32[NP]
    prefill_tile_q_start: jax.Array  # i32[NP] flat index of the tile's first token
    prefill_tile_pos0: jax.Array  # i32[NP] absolute position of the first token
    prefill_tile_kv_end: jax.Array  # i32[NP] 1 + position of the last real token
    prefill_num_tiles: jax.Array  # i32[1] tiles in use
    # Pallas path: tiles of pallas_block_q tokens over all sequences.
    tile_seq: jax.Array  # i32[NT]
    tile_q_start: jax.Array  # i32[NT]
    tile_pos0: jax.Array  # i32[NT]
    tile_kv_end: jax.Array  # i32[NT] 0 for unused tiles
    token_out_row: jax.Array  # i32[T] row tile * pallas_block_q + r of each token; -1 pad
    block_size: int  # B, tokens per KV page
    xla_block_q: int
    pallas_block_q: int


def _validate(slot_mapping, qsl, seq_lens, block_table, num_seqs, block_size):
    t, s = slot_mapping.shape[0], seq_lens.shape[0]
    if slot_mapping.ndim != 1 or qsl.shape != (s + 1,) or block_table.ndim != 2 \
            or block_table.shape[0] != s:
        raise ValueError(f"inconsistent shapes: slot_mapping={slot_mapping.shape} "
                         f"query_start_loc={qsl.shape} seq_lens={seq_lens.shape} "
                         f"block_table={block_table.shape}")
    if not 0 <= num_seqs <= s:
        raise ValueError(f"num_seqs={num_seqs} must lie in [0, S_pad={s}]")
    if block_size <= 0:
        raise ValueError(f"block_size={block_size} must be > 0")
    if qsl[0] != 0 or np.any(np.diff(qsl) < 0) or qsl[-1] > t:
        raise ValueError(f"query_start_loc={qsl} must start at 0, not decrease, and end "
                         f"<= T_pad={t}")
    q_lens = np.diff(qsl)[:num_seqs]
    if np.any(seq_lens[:num_seqs] < q_lens):
        raise ValueError(f"seq_lens={seq_lens[:num_seqs]} must be >= q_lens={q_lens}")
    cap = block_table.shape[1] * block_size
    if np.any(seq_lens > cap):
        raise ValueError(f"seq_lens max={seq_lens.max()} exceeds max_blocks_per_seq * "
                         f"block_size={cap}")


def make_attention_metadata(*, slot_mapping, query_start_loc, seq_lens, block_table, num_seqs,
                            block_size: int, num_queries_per_kv: int = 4,
                            pallas_block_q: int | None = None,
                            xla_block_q: int = XLA_BLOCK_Q) -> AttentionMetadata:
    """Build the attention metadata of one step on the host (vectorized NumPy).

    Args:
      slot_mapping: i32[T_pad]; query_start_loc: i32[S_pad+1]; seq_lens: i32[S_pad];
      block_table: i32[S_pad, max_blocks_per_seq]; num_seqs: int, sequences in use
        (tokens at flat index >= query_start_loc[num_seqs] belong to none).
      block_size: B, tokens per KV page.
      num_queries_per_kv: H / K, used to pick the Pallas tile when pallas_block_q is None.
      pallas_block_q, xla_block_q: tokens per query tile of each backend (static).

    Returns:
      AttentionMetadata with NumPy leaves (device_put it once per step).

    Raises:
      ValueError: inconsistent shapes, query_start_loc not a prefix sum within
        T_pad, seq_lens shorter than the queries or longer than the block table.
    """
    slot_mapping = np.asarray(slot_mapping, np.int32)
    qsl = np.asarray(query_start_loc, np.int32)
    seq_lens = np.asarray(seq_lens, np.int32)
    block_table = np.asarray(block_table, np.int32)
    num_seqs = int(np.asarray(num_seqs).reshape(-1)[0])
    _validate(slot_mapping, qsl, seq_lens, block_table, num_seqs, block_size)
    t, s = slot_mapping.shape[0], seq_lens.shape[0]
    real = np.arange(s) < num_seqs
    q_lens = np.where(real, np.diff(qsl), 0)  # [S]
    decode = q_lens == 1
    if pallas_block_q is None:
        pallas_block_q = choose_pallas_block_q(t, s, num_queries_per_kv)

    pre = rpa.query_tiles(qsl, seq_lens, np.where(q_lens >= 2, q_lens, 0), xla_block_q,
                          rpa.num_query_tiles(t, min(s, t // 2), xla_block_q))
    til = rpa.query_tiles(qsl, seq_lens, q_lens, pallas_block_q,
                          rpa.num_query_tiles(t, s, pallas_block_q))
    # Row of each real token in the Pallas kernel's tiled output.
    tok = np.arange(t)
    tok_seq = np.clip(np.searchsorted(qsl, tok, side="right") - 1, 0, s - 1)  # [T]
    rel = tok - qsl[tok_seq]
    tok_real = tok < qsl[num_seqs]
    out_row = (til["tile_offset"][tok_seq] + rel // pallas_block_q) * pallas_block_q \
        + rel % pallas_block_q
    return AttentionMetadata(
        slot_mapping=slot_mapping, query_start_loc=qsl, seq_lens=seq_lens,
        block_table=block_table, num_seqs=np.array([num_seqs], np.int32),
        decode_token_idx=np.where(decode, qsl[:-1], t).astype(np.int32),
        decode_kv_len=np.where(decode, seq_lens, 0).astype(np.int32),
        prefill_tile_seq=pre["tile_seq"], prefill_tile_q_start=pre["tile_q_start"],
        prefill_tile_pos0=pre["tile_pos0"], prefill_tile_kv_end=pre["tile_kv_end"],
        prefill_num_tiles=pre["num_tiles"],
        tile_seq=til["tile_seq"], tile_q_start=til["tile_q_start"], tile_pos0=til["tile_pos0"],
        tile_kv_end=til["tile_kv_end"],
        token_out_row=np.where(tok_real, out_row, -1).astype(np.int32),
        block_size=int(block_size), xla_block_q=int(xla_block_q),
        pallas_block_q=int(pallas_block_q))


def _stacked(k_cache, v_cache, layer):
    """Return ([L, N, B, K, D] caches, layer index, whether the input was per-layer)."""
    if layer is None:
        if k_cache.ndim != 4:
            raise ValueError(f"per-layer cache must be [N, B, K, D], got {k_cache.shape}")
        return k_cache[None], v_cache[None], jnp.int32(0), True
    if k_cache.ndim != 5:
        raise ValueError(f"stacked cache must be [L, N, B, K, D], got {k_cache.shape}")
    return k_cache, v_cache, jnp.asarray(layer, jnp.int32).reshape(()), False


def write_kv(k_cache, v_cache, k, v, md: AttentionMetadata, *, layer=None,
             backend: Backend = "xla", interpret: bool = False):
    """Scatter the step's new rows k, v [T, K, D] into the paged cache at md.slot_mapping.

    Caches are [L, N, B, K, D] with `layer` (traced i32 scalar) given, else [N, B, K, D].
    Padding tokens write into the null block 0. Returns (k_cache, v_cache).
    """
    kc, vc, li, unstack = _stacked(k_cache, v_cache, layer)
    if backend == "xla":
        kc, vc = kvu.write_kv_xla(kc, vc, k, v, md.slot_mapping, li)
    elif backend == "pallas":
        kc, vc = kvu.write_kv_pallas(kc, vc, k, v, md.slot_mapping, li, interpret=interpret)
    else:
        raise ValueError(f"backend={backend!r} must be 'xla' or 'pallas'")
    return (kc[0], vc[0]) if unstack else (kc, vc)


def attention(q, k_cache, v_cache, md: AttentionMetadata, *, layer=None, sm_scale: float,
              backend: Backend = "xla", interpret: bool = False):
    """Ragged paged causal attention of q [T, H, D] against the paged cache.

    The query at flat index t of sequence s sits at position
    seq_lens[s] - q_len[s] + (t - query_start_loc[s]) and sees keys at positions
    <= its own (the step's own K/V must already be written with `write_kv`).
    GQA: head h reads KV head h // (H / K).

    Args:
      q: [T, H, D]; k_cache, v_cache: [L, N, B, K, D] with `layer` given, else [N, B, K, D].
      md: AttentionMetadata of this step (device arrays).
      layer: traced i32 scalar or None.
      sm_scale: softmax scale.
      backend: "xla" or "pallas"; interpret: Pallas interpreter (CPU tests).

    Returns:
      [T, H, D] in q.dtype; rows of tokens that belong to no sequence are 0.

    Raises:
      ValueError: bad backend, H not a multiple of K, or mismatched shapes.
    """
    kc, vc, li, _ = _stacked(k_cache, v_cache, layer)
    t, h, d = q.shape
    if h % kc.shape[3] or kc.shape[4] != d or kc.shape[2] != md.block_size:
        raise ValueError(f"q={q.shape} does not fit cache={kc.shape} "
                         f"(block_size={md.block_size})")
    if backend == "pallas":
        chunk_pages = max(1, PALLAS_CHUNK // md.block_size)
        return rpa.ragged_paged_attention(
            q, kc, vc, li, md.block_table, md.tile_seq, md.tile_q_start, md.tile_pos0,
            md.tile_kv_end, md.token_out_row, sm_scale=float(sm_scale),
            block_q=md.pallas_block_q, pages_per_chunk=chunk_pages, interpret=interpret)
    if backend != "xla":
        raise ValueError(f"backend={backend!r} must be 'xla' or 'pallas'")
    return _xla_attention(q, kc, vc, li, md, float(sm_scale))


def _gather_pages(cache, layer, pg):
    """Pages pg (i32[n, cp]) of layer `layer` of cache [L, N, B, K, D] -> [n, cp*B, K, D].

    A row gather on the free [L*N, B*K*D] view: one contiguous page per index, which
    XLA:CPU copies ~1.5x faster than the 5-D gather (notes/perf.md).
    """
    nl, nb, bs, kh, d = cache.shape
    rows = cache.reshape(nl * nb, bs * kh * d).at[pg + layer * nb].get(mode="promise_in_bounds")
    return rows.reshape(pg.shape[0], pg.shape[1] * bs, kh, d)


def _flash_chunks(q, row_pos, kv_end, pages, kc, vc, layer, *, sm_scale, chunk_pages, n_chunks):
    """Online-softmax attention of tiles of rows against their sequences' pages.

    q: [n, K, M, D] (M rows per KV head: tokens x heads-in-group); row_pos: i32[n, M]
    position of each row; kv_end: i32[n] keys in use per tile; pages: i32[n, P'] page
    ids (P' a multiple of chunk_pages); kc, vc: [L, N, B, K, D]; n_chunks: traced trip
    count. Returns f32[n, K, M, D]. (Prefill tiles; decode rows use `_decode_split_kv`.)
    """
    n, kh, m, d = q.shape
    bs = kc.shape[2]
    ck = chunk_pages * bs
    j = jnp.arange(ck, dtype=jnp.int32)

    def body(c, carry):
        acc, m_i, l_i = carry  # [n, K, M, D], [n, K, M], [n, K, M]
        pg = lax.dynamic_slice_in_dim(pages, c * chunk_pages, chunk_pages, axis=1)  # [n, cp]
        # Gather straight from the stacked cache at `layer` (no per-layer copy).
        k = _gather_pages(kc, layer, pg)  # [n, CK, K, D]
        v = _gather_pages(vc, layer, pg)
        kpos = c * ck + j  # [CK]
        key_ok = kpos[None, :] < kv_end[:, None]  # [n, CK]
        valid = ((kpos[None, None, :] <= row_pos[:, :, None])
                 & key_ok[:, None, :])[:, None]  # [n, 1, M, CK]
        v = jnp.where(key_ok[:, :, None, None], v, jnp.zeros_like(v))  # 0 * NaN would leak
        # K before the key axis, so both dots are plain batched matmuls.
        k = k.transpose(0, 2, 1, 3)  # [n, K, CK, D]
        v = v.transpose(0, 2, 1, 3)
        s = jnp.einsum("nkmd,nkcd->nkmc", q, k, preferred_element_type=jnp.float32) * sm_scale
        s = jnp.where(valid, s, rpa.MASK_VALUE)
        m_new = jnp.maximum(m_i, s.max(-1))
        alpha = jnp.exp(m_i - m_new)
        p = jnp.where(valid, jnp.exp(s - m_new[..., None]), 0.0)
        pv = jnp.einsum("nkmc,nkcd->nkmd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return acc * alpha[..., None] + pv, m_new, l_i * alpha + p.sum(-1)

    init = (jnp.zeros((n, kh, m, d), jnp.float32),
            jnp.full((n, kh, m), rpa.MASK_VALUE, jnp.float32),
            jnp.zeros((n, kh, m), jnp.float32))
    acc, _, l_i = lax.fori_loop(0, n_chunks, body, init)
    return acc / jnp.where(l_i > 0.0, l_i, 1.0)[..., None]


def _decode_split_kv(q, kv_len, pages, kc, vc, layer, *, sm_scale, chunk_pages, multiply_sum):
    """Decode attention over a flat list of (sequence, KV chunk) work items (split-KV).

    Flash-decoding style (Dao et al. 2023): sequence s contributes ceil(kv_len[s] / CK)
    items; each loop iteration takes the next S items, whatever sequences they belong to,
    and the per-item partial softmax states are merged per sequence at the end. The cost
    follows the sum of the real context lengths, not S_pad x the longest one: padded
    slots (kv_len 0) and short rows next to a long one cost nothing.

    q: [S, K, G, D]; kv_len: i32[S] (0 = not a decode); pages: i32[S, P'] (P' a multiple
    of chunk_pages). Returns f32[S, K, G, D], 0 for rows with kv_len 0.
    """
    n, kh, g, d = q.shape
    bs = kc.shape[2]
    ck = chunk_pages * bs
    max_items = n * (pages.shape[1] // chunk_pages)
    n_iter_max = -(-max_items // n)
    cnt = (kv_len + ck - 1) // ck  # [S] items per sequence
    end = jnp.cumsum(cnt)  # [S] exclusive end of each sequence's items
    start = end - cnt
    total = end[-1]
    j = jnp.arange(ck, dtype=jnp.int32)
    cols = jnp.arange(chunk_pages, dtype=jnp.int32)

    def item_rows(idx):  # flat item ids -> (row, chunk, valid)
        row = jnp.minimum(jnp.sum(idx[:, None] >= end[None, :], -1), n - 1)
        return row, idx - start[row], idx < total

    def body(it, carry):
        m_buf, l_buf, acc_buf = carry
        idx = it * n + jnp.arange(n, dtype=jnp.int32)  # [W] with W = S items per iteration
        row, chunk, ok = item_rows(idx)
        pg = pages[row[:, None], chunk[:, None] * chunk_pages + cols[None, :]]  # [W, cp]
        pg = jnp.where(ok[:, None], pg, 0)
        kpos = chunk[:, None] * ck + j[None, :]  # [W, CK]
        key_ok = (kpos < kv_len[row][:, None]) & ok[:, None]  # [W, CK]
        k = _gather_pages(kc, layer, pg)  # [W, CK, K, D]
        v = _gather_pages(vc, layer, pg)
        v = jnp.where(key_ok[:, :, None, None], v, jnp.zeros_like(v))  # 0 * NaN would leak
        qi = q[row].astype(jnp.float32)  # [W, K, G, D]
        if multiply_sum:
            s = jnp.sum(qi[:, None] * k[:, :, :, None, :].astype(jnp.float32), -1)  # [W, CK, K, G]
            s = s.transpose(0, 2, 3, 1) * sm_scale  # [W, K, G, CK]
        else:
            s = jnp.einsum("wkgd,wckd->wkgc", qi, k, preferred_element_type=jnp.float32) * sm_scale
        valid = key_ok[:, None, None, :]
        s = jnp.where(valid, s, rpa.MASK_VALUE)
        m = s.max(-1)  # [W, K, G]
        p = jnp.where(valid, jnp.exp(s - m[..., None]), 0.0)
        if multiply_sum:
            pv = jnp.sum(p.transpose(0, 3, 1, 2)[..., None] * v[:, :, :, None, :].astype(jnp.float32),
                         1)  # [W, K, G, D]
        else:
            pv = jnp.einsum("wkgc,wckd->wkgd", p, v.astype(jnp.float32),
                            preferred_element_type=jnp.float32)
        at = it * n
        return (lax.dynamic_update_slice_in_dim(m_buf, m, at, 0),
                lax.dynamic_update_slice_in_dim(l_buf, p.sum(-1), at, 0),
                lax.dynamic_update_slice_in_dim(acc_buf, pv, at, 0))

    nb = n_iter_max * n
    init = (jnp.full((nb, kh, g), rpa.MASK_VALUE, jnp.float32), jnp.zeros((nb, kh, g), jnp.float32),
            jnp.zeros((nb, kh, g, d), jnp.float32))
    m_buf, l_buf, acc_buf = lax.fori_loop(0, (total + n - 1) // n, body, init)
    # Merge the partial states per sequence; unused slots go to the extra segment n.
    row, _, ok = item_rows(jnp.arange(nb, dtype=jnp.int32))
    seg = jnp.where(ok, row, n)
    m_row = jax.ops.segment_max(m_buf, seg, num_segments=n + 1)  # [S+1, K, G]
    w = jnp.where(ok[:, None, None], jnp.exp(m_buf - m_row[seg]), 0.0)  # [NB, K, G]
    l_row = jax.ops.segment_sum(l_buf * w, seg, num_segments=n + 1)[:n]
    acc = jax.ops.segment_sum(acc_buf * w[..., None], seg, num_segments=n + 1)[:n]
    return acc / jnp.where(l_row > 0.0, l_row, 1.0)[..., None]


def _pad_pages(block_table, chunk_pages):
    return jnp.pad(block_table, ((0, 0), (0, -block_table.shape[1] % chunk_pages)))


def _xla_attention(q, kc, vc, layer, md: AttentionMetadata, sm_scale: float):
    t, h, d = q.shape
    kh = kc.shape[3]
    g = h // kh
    bs = kc.shape[2]
    bq = md.xla_block_q
    # One zero row at index T (target of non-decode slots) and bq rows of tile overhang.
    qg = jnp.pad(q.reshape(t, kh, g, d), ((0, bq), (0, 0), (0, 0), (0, 0)))
    out = jnp.zeros((t + bq, kh, g, d), jnp.float32)

    # Decode rows: one query per sequence slot, all slots batched.
    dcp = max(1, XLA_DECODE_CHUNK // bs)
    dq = qg[md.decode_token_idx]  # [S, K, G, D]
    o_dec = _decode_split_kv(dq, md.decode_kv_len, _pad_pages(md.block_table, dcp), kc, vc,
                             layer, sm_scale=sm_scale, chunk_pages=dcp,
                             multiply_sum=XLA_DECODE_MULSUM)  # [S, K, G, D]
    out = out.at[md.decode_token_idx].set(o_dec)

    # Prefill tiles, one at a time, each up to its own causal end.
    pcp = max(1, XLA_PREFILL_CHUNK // bs)
    pages = _pad_pages(md.block_table, pcp)

    def tile(i, out):
        q_start, kv_end = md.prefill_tile_q_start[i], md.prefill_tile_kv_end[i]
        pos = md.prefill_tile_pos0[i] + jnp.arange(bq, dtype=jnp.int32)  # [bq]
        qt = lax.dynamic_slice_in_dim(qg, q_start, bq)  # [bq, K, G, D]
        qt = qt.transpose(1, 0, 2, 3).reshape(1, kh, bq * g, d)  # rows m = token * G + head
        ot = _flash_chunks(qt, jnp.repeat(pos, g)[None], kv_end[None],
                           pages[md.prefill_tile_seq[i]][None], kc, vc, layer,
                           sm_scale=sm_scale, chunk_pages=pcp,
                           n_chunks=-(-kv_end // (pcp * bs)))  # [1, K, bq * G, D]
        ot = ot.reshape(kh, bq, g, d).transpose(1, 0, 2, 3)  # [bq, K, G, D]
        old = lax.dynamic_slice_in_dim(out, q_start, bq)
        keep = (pos < kv_end)[:, None, None, None]  # rows past the sequence's end
        return lax.dynamic_update_slice_in_dim(out, jnp.where(keep, ot, old), q_start, 0)

    out = lax.fori_loop(0, md.prefill_num_tiles[0], tile, out)
    return out[:t].reshape(t, h, d).astype(q.dtype)
