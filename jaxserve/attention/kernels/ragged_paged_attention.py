"""Ragged paged attention: a Pallas (Triton backend) kernel and its wrapper.

One launch serves any mix of decodes (q_len = 1), fresh prefills and chunked
prefills (queries at the end of an already-cached context): the token axis is
ragged (`query_start_loc`), the KV cache is paged (`block_table`, vLLM's
PagedAttention, Kwon et al. SOSP'23), and the softmax is computed online over
KV chunks (FlashAttention-2, Dao 2023). The query tiling follows vLLM's Triton
"unified attention": a tile holds `block_q` consecutive tokens of ONE sequence
times the `G = H / K` query heads that share a KV head, so a decode of a GQA
model still fills the matrix unit's rows.

Layers (as in jax/experimental/pallas/ops/gpu):
  * `_rpa_kernel`: the kernel body; its online softmax is
    `jaxserve.attention.kernels.online_softmax.online_softmax_step`, shared with the xla path.
  * `ragged_paged_attention`: the jitted wrapper (static, keyword-only tiles).
The host tiling (`query_tiles`) is in `jaxserve.attention.common`, the
backend object that builds this kernel's metadata in
`jaxserve.attention.pallas_triton`, and the float64 reference it is tested
against in `jaxserve.attention.reference`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.attention.kernels.online_softmax import init_state, normalize, online_softmax_step
from jaxserve.attention.kernels.tiling import next_pow2, window_scalar  # noqa: F401 - re-exported


# ----------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------

def _rpa_kernel(layer_ref,  # i32[1]
                window_ref,  # i32[1] keys a query sees, itself included (sliding window)
                tile_seq_ref, tile_q_start_ref, tile_pos0_ref, tile_kv_end_ref,  # i32[NT]
                block_table_ref,  # i32[S, P_pad]
                q_ref,  # [K, (T + block_q) * Gp, D], row = token * Gp + head-in-group
                k_ref, v_ref,  # [L, N * B, K, D] (whole cache, HBM)
                o_ref,  # [M, D] with M = block_q * Gp: this program's tile
                *, sm_scale: float, block_q: int, group_pad: int, block_size: int,
                pages_per_chunk: int, precision):
    tile = pl.program_id(0)
    kvh = pl.program_id(1)
    seq = tile_seq_ref[tile]
    pos0 = tile_pos0_ref[tile]
    kv_end = tile_kv_end_ref[tile]
    layer = layer_ref[0]
    window = window_ref[0]
    kv_lo = jnp.maximum(pos0 - window + 1, 0)  # the first key any row of the tile sees
    m_rows = block_q * group_pad
    chunk = pages_per_chunk * block_size

    q = q_ref[kvh, pl.ds(tile_q_start_ref[tile] * group_pad, m_rows), :]  # [M, D]
    row_pos = pos0 + lax.broadcasted_iota(jnp.int32, (m_rows,), 0) // group_pad  # [M]
    j = lax.broadcasted_iota(jnp.int32, (chunk,), 0)  # [CK]

    def body(c, state):
        kpos = c * chunk + j  # [CK] absolute key positions
        page = block_table_ref[seq, c * pages_per_chunk + j // block_size]  # [CK]
        rows = page * block_size + j % block_size  # [CK] row in the N*B axis
        k = k_ref[layer, rows, kvh, :].astype(q.dtype)  # [CK, D]; a 16-bit cache upcast
        v = v_ref[layer, rows, kvh, :].astype(q.dtype)  # [CK, D]
        s = plgpu.dot(q, k, trans_b=True, precision=precision).astype(jnp.float32) * sm_scale
        key_ok = (kpos < kv_end) & (kpos >= kv_lo)  # [CK]; slots outside may hold NaN
        valid = ((kpos[None, :] <= row_pos[:, None]) & (kpos[None, :] > row_pos[:, None] - window)
                 & key_ok[None, :])  # [M, CK] causal, within the window
        v = jnp.where(key_ok[:, None], v, jnp.zeros_like(v))  # 0 * NaN would leak
        return online_softmax_step(state, s, valid, lambda p: plgpu.dot(
            p.astype(v.dtype), v, precision=precision).astype(jnp.float32))

    # Chunks wholly before the window are not read.
    acc, _, l_i = lax.fori_loop(kv_lo // chunk, pl.cdiv(kv_end, chunk), body,
                                init_state((m_rows,), q.shape[-1]))
    o_ref[...] = normalize(acc, l_i).astype(o_ref.dtype)  # rows with no key (padding) -> 0


def check_kernel_shapes(*, head_dim: int, num_queries_per_kv: int, block_q: int,
                        block_size: int, pages_per_chunk: int) -> None:
    """Raise ValueError unless the Triton lowering can take these shapes.

    Triton needs power-of-two array sizes and `tl.dot` needs every dim >= 16.
    """
    m_rows = block_q * next_pow2(num_queries_per_kv)
    chunk = pages_per_chunk * block_size
    for name, v in (("head_dim", head_dim), ("block_q * next_pow2(H/K)", m_rows),
                    ("pages_per_chunk * block_size", chunk)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"pallas ragged attention needs {name}={v} to be a power of two >= 16")


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "block_q", "pages_per_chunk", "num_warps", "num_stages", "interpret"))
def ragged_paged_attention(q, k_cache, v_cache, layer, block_table, tile_seq, tile_q_start,
                           tile_pos0, tile_kv_end, token_out_row, *, sm_scale: float,
                           block_q: int, pages_per_chunk: int, num_warps: int = 4,
                           num_stages: int = 2, interpret: bool = False, sliding_window=None):
    """Ragged paged attention over a stacked KV cache (Pallas, Triton backend).

    Args:
      q: [T, H, D] queries (bf16 or f32).
      k_cache, v_cache: [L, N, B, K, D] stacked caches (`L` may be 1).
      layer: i32[] or i32[1], the layer to read.
      block_table: i32[S, P] page ids; padded entries point at the null block 0.
      tile_seq, tile_q_start, tile_pos0, tile_kv_end: i32[NT] from `query_tiles`
        built with the same `block_q`.
      token_out_row: i32[T], row `tile * block_q + r` of each token in the tiled
        output; -1 for tokens that belong to no sequence (their output is 0).
      sm_scale: softmax scale (usually D ** -0.5).
      block_q: tokens per query tile (static); the tile has block_q * next_pow2(H/K) rows.
      pages_per_chunk: KV pages loaded per inner-loop step (static).
      num_warps, num_stages: Triton launch parameters.
      interpret: run the kernel with the Pallas interpreter (CPU tests).
      sliding_window: i32 scalar (data) or None: a query at position p sees keys at
        positions > p - sliding_window only; pages wholly before that are not read.

    Returns:
      [T, H, D] in q.dtype. Rows of tokens that belong to no sequence are 0.

    Raises:
      ValueError: inconsistent shapes, H not a multiple of K, or shapes Triton cannot take.
    """
    t, h, d = q.shape
    n_layers, n_blocks, bs, kh, dk = k_cache.shape
    if k_cache.shape != v_cache.shape or dk != d or h % kh:
        raise ValueError(f"bad shapes: {q.shape=} {k_cache.shape=} {v_cache.shape=}")
    g = h // kh
    gp = next_pow2(g)
    check_kernel_shapes(head_dim=d, num_queries_per_kv=g, block_q=block_q, block_size=bs,
                        pages_per_chunk=pages_per_chunk)
    nt = tile_seq.shape[0]
    m_rows = block_q * gp
    # Pad the block table so a chunk of pages never reads past its last column.
    p = block_table.shape[1]
    block_table = jnp.pad(block_table, ((0, 0), (0, -p % pages_per_chunk)))
    # q -> [K, (T + block_q) * Gp, D]: each tile reads one contiguous [M, D] slab.
    qg = jnp.pad(q.reshape(t, kh, g, d), ((0, block_q), (0, 0), (0, gp - g), (0, 0)))
    qg = qg.transpose(1, 0, 2, 3).reshape(kh, (t + block_q) * gp, d)
    # Free reshapes: the N and B axes merge into one row axis of the cache.
    kc = k_cache.reshape(n_layers, n_blocks * bs, kh, d)
    vc = v_cache.reshape(n_layers, n_blocks * bs, kh, d)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    window = window_scalar(sliding_window).reshape(1)
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(
        _rpa_kernel, sm_scale=float(sm_scale), block_q=block_q, group_pad=gp, block_size=bs,
        pages_per_chunk=pages_per_chunk, precision=precision)
    whole = pl.BlockSpec()  # whole array per program (Triton: a plain pointer)
    o = pl.pallas_call(
        kernel,
        grid=(nt, kh),
        in_specs=[whole] * 10,
        out_specs=pl.BlockSpec((None, None, m_rows, d), lambda i, k: (i, k, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((nt, kh, m_rows, d), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=(f"ragged_paged_attention_bq{block_q}_gp{gp}_ppc{pages_per_chunk}_bs{bs}_d{d}"
              f"_w{num_warps}"),
    )(layer, window, tile_seq, tile_q_start, tile_pos0, tile_kv_end, block_table, qg, kc, vc)
    # [NT, K, block_q, Gp, D] -> per-token rows [T, K, Gp, D] -> [T, H, D]
    o = o.reshape(nt, kh, block_q, gp, d)
    row = jnp.maximum(token_out_row, 0)
    o = o[row // block_q, :, row % block_q][:, :, :g].reshape(t, h, d)
    return jnp.where(token_out_row[:, None, None] >= 0, o, jnp.zeros_like(o))
