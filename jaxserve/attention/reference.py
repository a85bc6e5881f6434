"""Float64 NumPy references of ragged paged attention and of the paged KV write.

Backend-neutral: every attention backend (xla, pallas_triton, and later
pallas_mosaic) is tested against these, one sequence at a time, with no tiling.
"""

from __future__ import annotations

import numpy as np

def reference_ragged_paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens,
                                     block_table, num_seqs: int, *, sm_scale: float,
                                     sliding_window: int | None = None) -> np.ndarray:
    """Float64 NumPy reference, one sequence at a time.

    Args:
      q: [T, H, D]; k_cache, v_cache: [N, B, K, D] (one layer);
      query_start_loc: i32[S+1]; seq_lens: i32[S]; block_table: i32[S, P];
      num_seqs: sequences in use. The query at flat index t of sequence s has
      position seq_lens[s] - q_len[s] + (t - query_start_loc[s]) and sees keys at
      positions <= its own, and with `sliding_window` W only those > its own - W
      (transformers' sliding-window mask). Keys no query of a sequence sees are never
      read (the tests poison them with NaN).

    Returns:
      f64[T, H, D]; rows of tokens that belong to no sequence are 0.
    """
    q = np.asarray(q, np.float64)
    kc = np.asarray(k_cache, np.float64)
    vc = np.asarray(v_cache, np.float64)
    t, h, d = q.shape
    bs, kh = kc.shape[1], kc.shape[2]
    g = h // kh
    out = np.zeros((t, h, d))
    for s in range(num_seqs):
        lo, hi, n = int(query_start_loc[s]), int(query_start_loc[s + 1]), int(seq_lens[s])
        if hi == lo:
            continue
        pages = np.asarray(block_table[s])[: -(-n // bs)]
        qpos = n - (hi - lo) + np.arange(hi - lo)
        kpos = np.arange(n)
        seen = kpos <= qpos[-1]
        mask = kpos[None, :] <= qpos[:, None]  # [q, n]
        if sliding_window is not None:
            seen &= kpos > qpos[0] - sliding_window
            mask &= kpos[None, :] > qpos[:, None] - sliding_window
        k = np.where(seen[:, None, None], kc[pages].reshape(-1, kh, d)[:n], 0.0)  # [n, K, D]
        v = np.where(seen[:, None, None], vc[pages].reshape(-1, kh, d)[:n], 0.0)
        qs = q[lo:hi].reshape(hi - lo, kh, g, d)
        sc = np.einsum("qkgd,nkd->qkgn", qs, k) * sm_scale
        sc = np.where(mask[:, None, None], sc, -np.inf)
        p = np.exp(sc - sc.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[lo:hi] = np.einsum("qkgn,nkd->qkgd", p, v).reshape(hi - lo, h, d)
    return out


def reference_write_kv(k_cache, v_cache, k, v, slot_mapping, layer: int, *, num_real_tokens: int):
    """NumPy reference: copy of the caches with the first `num_real_tokens` rows written.

    Padding tokens (index >= num_real_tokens) write into the null block with
    unspecified winners, so the reference leaves block 0 to the caller to ignore.
    """
    kc, vc = np.array(k_cache), np.array(v_cache)
    bs = kc.shape[2]
    for t in range(num_real_tokens):
        s = int(slot_mapping[t])
        kc[layer, s // bs, s % bs] = k[t]
        vc[layer, s // bs, s % bs] = v[t]
    return kc, vc
