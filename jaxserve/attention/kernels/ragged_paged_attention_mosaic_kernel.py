"""The Mosaic GPU ragged paged-attention kernel body (see ragged_paged_attention_mosaic.py).

One program = one query tile x one KV head; the wrapper, tiles and shape checks are
in `jaxserve.attention.kernels.ragged_paged_attention_mosaic` (the module to import), the host
metadata in `jaxserve.attention.pallas_mosaic`. Kept apart so that each file
stays readable. At module level this file imports only `jaxserve.attention.kernels.online_softmax`
from the project (no import cycle through the attention package).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

# The one finite mask value of every attention path (see online_softmax's docstring).
from jaxserve.attention.kernels.online_softmax import MASK_VALUE
SWIZZLE = 128  # bytes; the minor SMEM tile is SWIZZLE / itemsize elements


@dataclasses.dataclass(frozen=True)
class KernelStatic:
    """Everything the kernel body needs at trace time."""

    m: int  # rows per tile = block_q * gp
    gp: int  # query heads per KV head, padded to a power of two
    ck: int  # keys per chunk
    ppc: int  # pages per chunk
    bs: int  # tokens per page
    d: int  # head_dim
    depth: int  # SMEM slots
    wgs: int  # warpgroups (2 = one producer)
    sm_scale: float
    split: bool  # fp32 input: bf16x3 split products


def _layout(dtype):
    """SMEM transforms a WGMMA operand of `dtype` needs: (8, 128B) tiles, 128-byte swizzle."""
    return (plgpu.TilingTransform((8, SWIZZLE // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(SWIZZLE))


def kernel_scratch(st: KernelStatic, dtype):
    """The kernel's SMEM buffers and barriers, as a dict of scratch types."""
    sm = lambda shape, dt: plgpu.SMEM(shape, dt, transforms=_layout(dt))  # noqa: E731
    bf = jnp.bfloat16
    out = dict(q=sm((st.m, st.d), dtype), k=sm((st.depth, st.ck, st.d), dtype),
               v=sm((st.depth, st.ck, st.d), dtype),
               q_bar=plgpu.Barrier(num_barriers=1),
               kv_bar=plgpu.Barrier(num_arrivals=2 * st.ppc, num_barriers=st.depth))
    if st.split:  # bf16 hi/lo operands; P needs two as well
        out.update(q2=sm((2, st.m, st.d), bf), k2=sm((2, st.ck, st.d), bf),
                   v2=sm((2, st.ck, st.d), bf), p=sm((2, st.m, st.ck), bf))
    else:
        out["p"] = sm((st.m, st.ck), dtype)
    if st.wgs == 2:
        out["free_bar"] = plgpu.Barrier(num_arrivals=1, num_barriers=st.depth)
    return out


def _issue_chunk(st: KernelStatic, sc, k_ref, v_ref, bt_ref, *, layer, seq, kvh, c, slot):
    """TMA-copy chunk c's pages (K and V) into SMEM slot `slot`; all land on kv_bar[slot]."""
    for i in range(st.ppc):
        page = bt_ref[seq, c * st.ppc + i]
        rows = pl.ds(i * st.bs, st.bs)
        plgpu.copy_gmem_to_smem(k_ref.at[layer, page, :, kvh, :], sc["k"].at[slot, rows],
                                sc["kv_bar"].at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[layer, page, :, kvh, :], sc["v"].at[slot, rows],
                                sc["kv_bar"].at[slot])


def _split_store(x, dst):
    """Store f32 x as bf16 hi = bf16(x) and lo = bf16(x - hi) into dst[0], dst[1]."""
    hi = x.astype(jnp.bfloat16)
    dst[0] = hi
    dst[1] = (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)


def _mma(st: KernelStatic, a, b, *, shape, b_t: bool):
    """a @ b as f32 [shape] in registers (b transposed from its [N, K] SMEM layout when b_t).

    With `st.split`, a and b are [2, ...] hi/lo buffers and the product is
    hi@hi + hi@lo + lo@hi (lo@lo is ~2^-16 of the result). A fresh accumulator per
    call (`run_scoped`), added to the running output in registers by the caller:
    the GPU interpreter does not implement `run_state`, so `ACC.init(acc)` (FA3's
    in-place accumulate) cannot be tested on CPU.
    """
    pairs = ((0, 0), (0, 1), (1, 0)) if st.split else ((None, None),)

    def body(acc_ref):
        for i, j in pairs:
            ai = a if i is None else a.at[i]
            bj = b if j is None else b.at[j]
            plgpu.wgmma(acc_ref, ai, bj.T if b_t else bj)
        return acc_ref[...]  # waits for the WGMMAs

    return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


def _zero_keys_outside(st: KernelStatic, v, kv_lo, kv_end, c):
    """v [CK, D] (registers) of chunk c with rows of keys outside [kv_lo, kv_end) set to 0
    (past the end or before the sliding window: they may hold NaN)."""
    key = c * st.ck + plgpu.broadcasted_iota(jnp.int32, (st.ck, st.d), 0, layout=plgpu.Layout.WGMMA)
    return jnp.where((key < kv_end) & (key >= kv_lo), v, jnp.zeros_like(v))


def _bcast(x, shape):
    return lax.broadcast_in_dim(x, shape, [0])


def _chunk(st: KernelStatic, sc, i, carry, *, c0, kv_lo, kv_end, window, row_pos, release):
    """The i-th KV chunk (chunk c0 + i of the sequence) of the online softmax;
    `release(slot)` frees the slot for the producer."""
    acc, m_i, l_i = carry
    slot = lax.rem(i, st.depth)
    c = c0 + i
    plgpu.barrier_wait(sc["kv_bar"].at[slot])
    if st.split:  # f32: stage into bf16 hi/lo copies; the f32 slot is free right after
        _split_store(sc["k"].at[slot][...], sc["k2"])
        _split_store(_zero_keys_outside(st, sc["v"].at[slot][...], kv_lo, kv_end, c), sc["v2"])
        plgpu.commit_smem()
        release(slot)
        q, k, v = sc["q2"], sc["k2"], sc["v2"]
    else:
        # only the last chunk holds keys past the end, the first keys before the window
        @pl.when((c * st.ck + st.ck > kv_end) | (c * st.ck < kv_lo))
        def _():
            sc["v"].at[slot][...] = _zero_keys_outside(st, sc["v"].at[slot][...], kv_lo, kv_end, c)
            plgpu.commit_smem()
        q, k, v = sc["q"], sc["k"].at[slot], sc["v"].at[slot]
    s = _mma(st, q, k, shape=(st.m, st.ck), b_t=True) * st.sm_scale  # [M, CK] f32
    key = c * st.ck + plgpu.broadcasted_iota(jnp.int32, (st.m, st.ck), 1,
                                             layout=plgpu.Layout.WGMMA)
    # causal, within the window, and nothing past the tile's end
    valid = (key <= row_pos) & (key > row_pos - window) & (key < kv_end)
    s = jnp.where(valid, s, MASK_VALUE)
    m_new = jnp.maximum(m_i, s.max(axis=1))
    alpha = jnp.exp(m_i - m_new)
    p = jnp.where(valid, jnp.exp(s - _bcast(m_new, s.shape)), 0.0)
    l_i = l_i * alpha + p.sum(axis=1)
    if st.split:
        _split_store(p, sc["p"])
    else:
        sc["p"][...] = p.astype(sc["p"].dtype)
    plgpu.commit_smem()
    acc = acc * _bcast(alpha, acc.shape) + _mma(st, sc["p"], v, shape=acc.shape, b_t=False)
    if not st.split:
        release(slot)  # the PV MMA has read V (its result was waited for)
    return acc, m_new, l_i


def _consumer(st: KernelStatic, sc, refs, *, issue):
    """The compute warpgroup: Q load, the chunk loop, the normalized tile store."""
    _, window_ref, _, pos0_ref, kvend_ref, _, q_ref, _, _, o_ref = refs
    tile, kvh = lax.axis_index("tile"), lax.axis_index("kv_head")
    kv_end, pos0, window = kvend_ref[tile], pos0_ref[tile], window_ref[0]
    kv_lo, c0, n_chunks = _chunk_range(st, pos0, kv_end, window)
    plgpu.copy_gmem_to_smem(q_ref.at[kvh, tile], sc["q"], sc["q_bar"].at[0])
    if issue is not None:  # one warpgroup: prefetch the first `depth` chunks itself
        for i in range(st.depth):
            pl.when(i < n_chunks)(functools.partial(issue, c0 + i, i))
    plgpu.barrier_wait(sc["q_bar"].at[0])
    if st.split:
        _split_store(sc["q"][...], sc["q2"])
        plgpu.commit_smem()

    def release(slot, i):
        if issue is not None:  # refill the slot with the chunk `depth` further on
            pl.when(i + st.depth < n_chunks)(lambda: issue(c0 + i + st.depth, slot))
        else:
            pl.when(i + st.depth < n_chunks)(lambda: plgpu.barrier_arrive(sc["free_bar"].at[slot]))

    rows = plgpu.broadcasted_iota(jnp.int32, (st.m, st.ck), 0, layout=plgpu.Layout.WGMMA)
    row_pos = pos0 + lax.div(rows, st.gp)
    wg_row = plgpu.Layout.WGMMA.reduce(1)
    init = (plgpu.layout_cast(jnp.zeros((st.m, st.d), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((st.m,), MASK_VALUE, jnp.float32), wg_row),
            plgpu.layout_cast(jnp.zeros((st.m,), jnp.float32), wg_row))

    def body(i, carry):
        return _chunk(st, sc, i, carry, c0=c0, kv_lo=kv_lo, kv_end=kv_end, window=window,
                      row_pos=row_pos, release=lambda slot: release(slot, i))

    acc, _, l_i = lax.fori_loop(0, n_chunks, body, init)
    l_i = jnp.where(l_i > 0.0, l_i, 1.0)  # rows with no key (padding tiles) -> 0, not NaN
    sc["q"][...] = (acc / _bcast(l_i, acc.shape)).astype(sc["q"].dtype)  # Q's slot is free
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(sc["q"], o_ref.at[tile, kvh])
    plgpu.wait_smem_to_gmem(0)


def _chunk_range(st: KernelStatic, pos0, kv_end, window):
    """(kv_lo, c0, n): the first key any row of the tile sees under the sliding window,
    the chunk holding it, and the chunks from there to kv_end (those before are skipped)."""
    kv_lo = jnp.maximum(pos0 - window + 1, 0)
    c0 = lax.div(kv_lo, st.ck)
    return kv_lo, c0, jnp.maximum(lax.div(kv_end + (st.ck - 1), st.ck) - c0, 0)


def _producer(st: KernelStatic, sc, issue, c0, n_chunks):
    """The copy warpgroup (num_warpgroups=2): fill each slot once the consumer frees it."""
    @pl.loop(0, n_chunks)
    def _(i):
        slot = lax.rem(i, st.depth)
        pl.when(i >= st.depth)(lambda: plgpu.barrier_wait(sc["free_bar"].at[slot]))
        issue(c0 + i, slot)


def rpa_kernel(*refs, st: KernelStatic, **sc):
    """The kernel body (`plgpu.kernel` over grid (tile, kv_head), scratch from `kernel_scratch`)."""
    # i32[1] layer, i32[1] window, i32[NT] x 3, i32[S, P'], Q tiles [K, NT, M, D],
    # caches [L, N, B, K, D], output tiles [NT, K, M, D]
    layer_ref, window_ref, seq_ref, pos0_ref, kvend_ref, bt_ref, _, k_ref, v_ref, _ = refs
    tile, kvh = lax.axis_index("tile"), lax.axis_index("kv_head")

    def issue(c, slot):
        _issue_chunk(st, sc, k_ref, v_ref, bt_ref, layer=layer_ref[0], seq=seq_ref[tile],
                     kvh=kvh, c=c, slot=slot)

    if st.wgs == 1:
        _consumer(st, sc, refs, issue=issue)
        return
    wg = lax.axis_index("wg")
    pl.when(wg == 0)(lambda: _consumer(st, sc, refs, issue=None))
    _, c0, n_chunks = _chunk_range(st, pos0_ref[tile], kvend_ref[tile], window_ref[0])
    pl.when(wg == 1)(lambda: _producer(st, sc, issue, c0, n_chunks))
