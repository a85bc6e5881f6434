"""Ragged paged attention on Pallas Mosaic GPU (Hopper): kernel, tiles, wrapper, host metadata.

The same contract as the Triton kernel in `ragged_paged_attention.py`: a ragged
token axis (`query_start_loc`), a paged KV cache (`block_table`, `seq_lens`; vLLM's
PagedAttention, Kwon et al. SOSP'23), any mix of decode, prefill and chunked-prefill
rows in one launch, GQA, an online softmax over KV chunks (FlashAttention-2, Dao
2023). One program = one query tile x one KV head: `block_q` tokens of ONE sequence
times the `G = H / K` query heads sharing that KV head (vLLM's Triton "unified
attention" tiling), so decode rows of a GQA model fill the tensor core's M = 64.

Per program, on one Hopper SM:
  * the tile's Q slab [M, D] is copied GMEM->SMEM by TMA once;
  * each KV chunk is `pages_per_chunk` pages; page p of the chunk is one TMA copy of
    the strided [B, D] slab `cache[layer, block_table[seq, p], :, kv_head, :]` into
    rows [p*B, (p+1)*B) of an SMEM slot, all completing on the slot's mbarrier;
    `pipeline_depth` slots are in flight, so chunk c+depth loads while c computes
    (FA3's producer/consumer pipeline, Shah et al. 2024);
  * S = Q K^T and P V are WGMMAs from SMEM into f32 register accumulators (P V is
    added to the running O in registers). P goes through SMEM: the GPU interpreter
    (jax 0.11/0.12) accepts only SMEM refs as the WGMMA A operand, and one [M, CK]
    bf16 store per chunk is cheap next to the chunk's K/V load;
  * keys at or past the tile's end (the partial last page, padded table entries that
    point at the null block) are masked in S and zeroed in V's SMEM copy of the
    last chunk (0 * NaN would leak into real rows).
fp32 caches take a slower path ("bf16x3"): the Hopper tensor core has no fp32 MMA and
its tf32 MMA rejects V's N-major layout, so each f32 operand x is split in-kernel
into hi = bf16(x), lo = bf16(x - hi) and every product is hi*hi + hi*lo + lo*hi (3
WGMMAs; relative error ~2^-16 instead of bf16's 2^-8).

The kernel body is in `ragged_paged_attention_mosaic_kernel.py`. The host side (per-tile
arrays from `jaxserve.attention.common.query_tiles`, `mosaic_metadata`) and the
backend object are in `jaxserve.attention.pallas_mosaic` (`PallasMosaicBackend`,
name "pallas_mosaic"); this module and the kernel file import nothing from
`jaxserve.attention` (its `__init__` imports the registry, which imports the
backends: a cycle).
KV write: this backend keeps the XLA scatter (`jaxserve.attention.xla.write_kv_xla`).
Per layer it moves T*K*D elements per cache (1 MiB for 512 tokens x 8 heads x 128 in
bf16), under 1% of what attention reads in the same step at 2k context, as one fused
scatter that XLA applies in place to the donated or scan-carried cache (no copy in the
compiled HLO, notes/attention.md). A Mosaic kernel would move the same bytes as one
TMA store per (token, head) row of 128-512 bytes (latency-bound, not faster) and would
need `input_output_aliases` threaded through the layer loop; there is nothing to gain.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxserve.attention.kernels.tiling import next_pow2, window_scalar  # noqa: F401 - re-exported
from jaxserve.attention.kernels.ragged_paged_attention_mosaic_kernel import (KernelStatic, kernel_scratch,
                                                                rpa_kernel)

SMEM_BYTES = 227 * 1024  # usable shared memory per block on H100/H200 (sm_90)
WGMMA_M = 64  # rows per warpgroup MMA instruction on Hopper


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
    """Static tile sizes of the Mosaic kernel (one compiled program per value).

    Fields:
      block_q: tokens of one sequence per tile. The tile has M = block_q * Gp rows,
        Gp = next_pow2(H / K), and M must be a multiple of 64 (the WGMMA M). Take the
        smallest legal value (64 // Gp) for decode-heavy buckets (a decode fills Gp
        rows, the rest is wasted MMA work but no extra memory traffic), and 2-4x that
        for prefill-heavy buckets (KV is re-read once per tile of a sequence, so larger
        tiles cut KV traffic by the same factor; M <= 128 keeps S and O in registers).
      pages_per_chunk: KV pages per pipeline step; CK = pages_per_chunk * block_size
        keys must be a multiple of 64 (the bf16 MMA K of P V with a 128-byte swizzle)
        and <= 256 (the MMA N of Q K^T). 64 keys per step suits decode (less masked
        work in the last chunk); 128 halves the loop overhead of long contexts.
      pipeline_depth: KV chunks in flight (SMEM slots). 2 hides one chunk's latency
        behind one chunk's compute; 3-4 helps when a chunk's compute is much shorter
        than a load (decode at long context). Bounded by SMEM (`smem_bytes`).
      num_warpgroups: 1 = the compute warpgroup also issues its TMA copies (fewest
        threads; right for decode, where the MMA work is tiny); 2 = FA3-style warp
        specialization: a second warpgroup only issues copies and waits on "slot
        consumed" barriers, so loads never wait on the softmax.
    """

    block_q: int = 16
    pages_per_chunk: int = 4
    pipeline_depth: int = 2
    num_warpgroups: int = 1


def default_tiles(num_queries_per_kv: int, block_size: int, *, head_dim: int = 128,
                  dtype=jnp.bfloat16, decode: bool = True) -> MosaicTiles:
    """Tiles for a bucket: M = 64 rows for decode, 128 for bf16 prefill when head_dim <= 64.

    One compute warpgroup holds S [M, 64] and O [M, D] in f32 registers: M = 128 at
    D = 128 would need ~256 registers per thread and spill, so D = 128 prefill keeps
    M = 64 (the re-read KV of a sequence's next tile is then mostly an L2 hit). f32's
    bf16x3 path needs more: its M = 128 tile at D = 64 spills (ptxas for sm_90a, deviceless:
    255 registers, 196 B), so f32 keeps M = 64 (227 registers, 0 B). f32 at D = 128
    spills even at the smallest tiles (M = 64, 64-key chunks, one slot: 68 B), so the
    engine does not pick this kernel there (`F32_MAX_HEAD_DIM`; notes/issue25.md).
    64-key chunks (or one page when B > 64), two slots in flight, or one when two do
    not fit in shared memory (fp32 at head_dim 128: its bf16 hi/lo copies take room).
    """
    gp = next_pow2(num_queries_per_kv)
    bf16 = jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16)
    rows = 2 * WGMMA_M if not decode and head_dim <= 64 and bf16 else WGMMA_M
    tiles = MosaicTiles(block_q=max(1, rows // gp), pages_per_chunk=max(1, 64 // block_size))
    used = smem_bytes(tiles, num_queries_per_kv=num_queries_per_kv, block_size=block_size,
                      head_dim=head_dim, dtype=dtype)
    return tiles if used <= SMEM_BYTES else dataclasses.replace(tiles, pipeline_depth=1)


# The largest head_dim whose f32 kernel compiles without register spills at the
# default tiles (D = 128: 68 B of spills at M = 64, CK = 64; measured deviceless).
F32_MAX_HEAD_DIM = 64
# The same for bf16: D = 256 (Gemma 3) holds O [64, 256] f32 in one warpgroup's registers
# and spills (255 registers, 560 B of spill stores at M = 64, CK = 64; deviceless ptxas for
# sm_90a, issue 31); D = 128 does not.
BF16_MAX_HEAD_DIM = 128


def spill_free(head_dim: int, dtype) -> bool:
    """Whether `default_tiles` compile without register spills for this head_dim and
    dtype on sm_90a (bf16: up to 128; f32: up to 64)."""
    f32 = jnp.dtype(dtype) == jnp.dtype(jnp.float32)
    return head_dim <= (F32_MAX_HEAD_DIM if f32 else BF16_MAX_HEAD_DIM)


def smem_bytes(tiles: MosaicTiles, *, num_queries_per_kv: int, block_size: int, head_dim: int,
               dtype) -> int:
    """Shared memory one program of the kernel allocates, in bytes (barriers excluded)."""
    m = tiles.block_q * next_pow2(num_queries_per_kv)
    ck, d, depth = tiles.pages_per_chunk * block_size, head_dim, tiles.pipeline_depth
    if jnp.dtype(dtype) == jnp.float32:
        # f32 Q/O and K/V staging + bf16 hi/lo copies of Q, K, V, P
        return 4 * (m * d + 2 * depth * ck * d) + 2 * 2 * (m * d + 2 * ck * d + m * ck)
    return 2 * (m * d + 2 * depth * ck * d + m * ck)  # Q/O, K/V slots, P


def check_tiles(tiles: MosaicTiles, *, num_queries_per_kv: int, block_size: int, head_dim: int,
                dtype) -> None:
    """Raise ValueError unless the Mosaic kernel can take these shapes (before any trace).

    Limits: M = block_q * next_pow2(H/K) a multiple of 64 and <= 256; B a multiple of 8;
    CK = pages_per_chunk * B a multiple of 64 and <= 256; head_dim a multiple of 64 and
    <= 256; dtype bf16 or f32; pipeline_depth >= 1; num_warpgroups 1 or 2; shared memory
    <= 227 KiB.
    """
    m = tiles.block_q * next_pow2(num_queries_per_kv)
    ck = tiles.pages_per_chunk * block_size
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"mosaic attention supports bfloat16 and float32, got "
                         f"dtype={jnp.dtype(dtype).name}")
    if m % WGMMA_M or m > 4 * WGMMA_M:
        raise ValueError(f"mosaic attention needs block_q * next_pow2(H/K)={m} to be a multiple "
                         f"of {WGMMA_M} and <= {4 * WGMMA_M} (block_q={tiles.block_q})")
    if block_size % 8:
        raise ValueError(f"mosaic attention needs block_size={block_size} to be a multiple of 8 "
                         f"(each page lands on whole 8-row SMEM tiles)")
    if ck % 64 or ck > 256:
        raise ValueError(f"mosaic attention needs pages_per_chunk * block_size={ck} to be a "
                         f"multiple of 64 and <= 256")
    if head_dim % 64 or head_dim > 256:
        raise ValueError(f"mosaic attention needs head_dim={head_dim} to be a multiple of 64 "
                         f"and <= 256")
    if tiles.pipeline_depth < 1 or tiles.num_warpgroups not in (1, 2):
        raise ValueError(f"pipeline_depth={tiles.pipeline_depth} must be >= 1 and "
                         f"num_warpgroups={tiles.num_warpgroups} must be 1 or 2")
    used = smem_bytes(tiles, num_queries_per_kv=num_queries_per_kv, block_size=block_size,
                      head_dim=head_dim, dtype=dtype)
    if used > SMEM_BYTES:
        raise ValueError(f"mosaic attention tiles {tiles} need {used} bytes of shared memory "
                         f"> {SMEM_BYTES} for head_dim={head_dim} dtype={jnp.dtype(dtype).name}")


# ----------------------------------------------------------------------------
# Wrappers
# ----------------------------------------------------------------------------

def _interpret_params(interpret):
    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    return plgpu.InterpretGPUParams() if interpret else None


@functools.partial(jax.jit, static_argnames=("sm_scale", "tiles", "interpret"))
def ragged_paged_attention_mosaic(q, k_cache, v_cache, layer, block_table, tile_seq,
                                  tile_q_start, tile_pos0, tile_kv_end, token_out_row, *,
                                  sm_scale: float, tiles: MosaicTiles,
                                  interpret: bool | plgpu.InterpretGPUParams = False,
                                  sliding_window=None):
    """Ragged paged attention over a stacked KV cache (Pallas, Mosaic GPU backend).

    Args:
      q: [T, H, D] queries, bf16 or f32 (f32 takes the bf16x3 path, see module doc).
      k_cache, v_cache: [L, N, B, K, D] stacked caches in q.dtype (`L` may be 1).
      layer: i32[] or i32[1], the layer to read (traced: one program for all layers).
      block_table: i32[S, P'] with P' a multiple of tiles.pages_per_chunk; padding 0.
      tile_seq, tile_q_start, tile_pos0, tile_kv_end: i32[NT] from
        `pallas_mosaic.mosaic_metadata` built with the same block_q.
      token_out_row: i32[T], row tile * block_q + r of each token; -1 for padding.
      sm_scale: softmax scale; tiles: static `MosaicTiles`.
      interpret: True (or an `plgpu.InterpretGPUParams`, e.g. with detect_races) runs
        the kernel in Pallas' GPU interpreter on CPU.
      sliding_window: i32 scalar (data) or None: a query at position p sees keys at
        positions > p - sliding_window only; chunks wholly before that are not loaded.

    Returns:
      [T, H, D] in q.dtype; rows of tokens in no sequence are 0.

    Raises:
      ValueError: inconsistent shapes or dtypes, or tiles the kernel cannot take
        (`check_tiles`).
    """
    t, h, d = q.shape
    n_layers, n_blocks, bs, kh, dk = k_cache.shape
    if k_cache.shape != v_cache.shape or dk != d or h % kh or k_cache.dtype != q.dtype \
            or v_cache.dtype != q.dtype:
        raise ValueError(f"bad shapes/dtypes: q={q.shape} {q.dtype} k_cache={k_cache.shape} "
                         f"{k_cache.dtype} v_cache={v_cache.shape} {v_cache.dtype}")
    if block_table.shape[1] % tiles.pages_per_chunk:
        raise ValueError(f"block_table width={block_table.shape[1]} must be a multiple of "
                         f"pages_per_chunk={tiles.pages_per_chunk} (see "
                         f"pallas_mosaic.mosaic_metadata)")
    g = h // kh
    check_tiles(tiles, num_queries_per_kv=g, block_size=bs, head_dim=d, dtype=q.dtype)
    gp, bq, nt = next_pow2(g), tiles.block_q, tile_seq.shape[0]
    st = KernelStatic(m=bq * gp, gp=gp, ck=tiles.pages_per_chunk * bs, ppc=tiles.pages_per_chunk,
                 bs=bs, d=d, depth=tiles.pipeline_depth, wgs=tiles.num_warpgroups,
                 sm_scale=float(sm_scale), split=q.dtype == jnp.float32)
    # q -> [K, NT, M, D], row r of tile i = token tile_q_start[i] + r // Gp, head r % Gp.
    # Gathered here (T*H*D elements, like the Triton wrapper's pad+transpose) so that
    # each tile's TMA source is a whole, tile-aligned [M, D] block: Mosaic's layout
    # inference rejects a TMA window starting at a dynamic row not known to be a
    # multiple of the SMEM tile's 8 rows.
    qg = jnp.pad(q.reshape(t, kh, g, d), ((0, bq), (0, 0), (0, gp - g), (0, 0)))
    qg = qg.transpose(1, 0, 2, 3).reshape(kh, (t + bq) * gp, d)
    qg = qg[:, tile_q_start[:, None] * gp + jnp.arange(st.m)[None, :]]
    wgs = dict(num_threads=2, thread_name="wg") if st.wgs == 2 else {}
    o = plgpu.kernel(
        functools.partial(rpa_kernel, st=st),
        out_type=jax.ShapeDtypeStruct((nt, kh, st.m, d), q.dtype),
        scratch_types=kernel_scratch(st, q.dtype),
        grid=(nt, kh), grid_names=("tile", "kv_head"), **wgs,
        interpret=_interpret_params(interpret),
        kernel_name=f"ragged_paged_attention_mosaic_bq{bq}_gp{gp}_ck{st.ck}_d{d}",
    )(jnp.asarray(layer, jnp.int32).reshape(1), window_scalar(sliding_window).reshape(1), tile_seq, tile_pos0, tile_kv_end, block_table,
      qg, k_cache, v_cache)
    # [NT, K, block_q, Gp, D] -> per-token rows [T, K, Gp, D] -> [T, H, D]
    o = o.reshape(nt, kh, bq, gp, d)
    row = jnp.maximum(token_out_row, 0)
    o = o[row // bq, :, row % bq][:, :, :g].reshape(t, h, d)
    return jnp.where(token_out_row[:, None, None] >= 0, o, jnp.zeros_like(o))

