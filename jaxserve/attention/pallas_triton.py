"""The "pallas_triton" attention backend: the Pallas Triton kernels, host tiling and metadata.

The kernels live in jaxserve/pallas/ (ragged_paged_attention.py, kv_cache_update.py);
this module chooses their tile per bucket, builds their metadata on the host, and
calls them with the backend's `interpret` flag (the Pallas interpreter runs them on
CPU for tests). The float64 reference they are tested against is
`reference.reference_ragged_paged_attention`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from jaxserve.attention.common import (TILED_FIELDS, CommonAttentionMetadata, TiledMetadata,
                                      host_common, stacked_cache, tiled_fields,
                                      tiled_kernel_args)
from jaxserve.attention.kernels import kv_cache_update as kvu
from jaxserve.attention.kernels import ragged_paged_attention as rpa


def choose_block_q(num_tokens: int, num_seqs: int, num_queries_per_kv: int, *,
                   head_dim: int = 0, dtype: str = "bfloat16") -> int:
    """Tokens per Pallas query tile for a (T_pad, S_pad) bucket.

    A tile has block_q * next_pow2(H/K) rows and `tl.dot` needs >= 16 rows.
    Decode-heavy buckets (<= 2 tokens per sequence) take the smallest legal tile
    (few wasted rows); prefill-heavy buckets take 64-row tiles, except f32 above
    head_dim 128: its 64-row tile at head_dim 256 spills 12,472 B on sm_90a (ptxas,
    deviceless, issue 31) where the 16-row one holds in 95 registers.
    """
    gp = rpa.next_pow2(num_queries_per_kv)
    min_bq = max(1, 16 // gp)
    if num_tokens <= 2 * num_seqs or (dtype == "float32" and head_dim > 128):
        return min_bq
    return max(min_bq, 64 // gp)


def choose_num_warps(m_rows: int, head_dim: int, dtype: str) -> int:
    """Warps of one kernel program: 8 for 64-row (prefill) tiles and for f32 at
    head_dim >= 128, else 4.

    Measured deviceless with ptxas (notes/issue25.md): with 4 warps the 64-row tile
    spills on sm_80 (bf16 d128: 255 registers, 8 B; f32 d64: 10.5 KB, f32's exact dot
    is an FMA loop) and on sm_90 (f32 d64: 1.4 KB); 8 warps spread the [M, D]
    accumulator over 256 threads: 128-222 registers, 0 spill. f32 at d128 also spills
    a 16-row tile with 4 warps on sm_90 (116 B); 8 warps and 32-key chunks
    (`chunk_keys_for`): 64 registers.
    """
    if m_rows >= 64 or (dtype == "float32" and head_dim >= 128):
        return 8
    return 4


def chunk_keys_for(head_dim: int, dtype: str) -> int:
    """Keys per inner-loop step: 64, or 32 for f32 at head_dim >= 128 (its 64-row tile
    with 64-key chunks spills on sm_80 even at 8 warps: 1,044 B; 32 keys: 0 B)."""
    return 32 if dtype == "float32" and head_dim >= 128 else 64


@functools.partial(jax.tree_util.register_dataclass, data_fields=TILED_FIELDS,
                   meta_fields=["block_q"])
@dataclasses.dataclass(frozen=True)
class PallasTritonMetadata(TiledMetadata):
    """The Triton kernel's step metadata: `TiledMetadata` and the static block_q."""

    block_q: int  # static: the kernel's tile (a new block_q is a new program)


@dataclasses.dataclass(frozen=True)
class PallasTritonBackend:
    """Ragged paged attention and the in-place KV write as Pallas Triton kernels.

    Args:
      block_size: B, tokens per KV page.
      num_queries_per_kv: H / K.
      head_dim: D.
      block_q: tokens per query tile; None picks it per bucket (`choose_block_q`).
      chunk_keys: keys per inner-loop step of the kernel (a multiple of B, or B); None:
        `chunk_keys_for(head_dim, dtype)`.
      dtype: the cache / activation dtype, "bfloat16" or "float32": with head_dim it
        picks the chunk and the warps (`choose_num_warps`) that compile without
        register spills.
      interpret: run both kernels in the Pallas interpreter (CPU tests).

    Raises:
      ValueError: shapes the Triton lowering cannot take (see `rpa.check_kernel_shapes`).
    """

    block_size: int
    num_queries_per_kv: int
    head_dim: int
    block_q: int | None = None
    chunk_keys: int | None = None
    dtype: str = "bfloat16"
    interpret: bool = False
    name: str = "pallas_triton"

    def __post_init__(self):
        bq = self.block_q or max(1, 16 // rpa.next_pow2(self.num_queries_per_kv))
        rpa.check_kernel_shapes(head_dim=self.head_dim, num_queries_per_kv=self.num_queries_per_kv,
                                block_q=bq, block_size=self.block_size,
                                pages_per_chunk=self.pages_per_chunk)

    @property
    def pages_per_chunk(self) -> int:
        keys = self.chunk_keys or chunk_keys_for(self.head_dim, self.dtype)
        return max(1, keys // self.block_size)

    def prepare(self, common: CommonAttentionMetadata) -> PallasTritonMetadata:
        """Validate the step and cut every sequence's tokens into tiles (host NumPy).

        Raises:
          ValueError: see `host_common`.
        """
        c = host_common(common, self.block_size)
        bq = self.block_q or choose_block_q(c.slot_mapping.shape[0], c.seq_lens.shape[0],
                                            self.num_queries_per_kv, head_dim=self.head_dim,
                                            dtype=self.dtype)
        return PallasTritonMetadata(**tiled_fields(c, c.block_table, bq), block_q=int(bq))

    def write_kv(self, k_cache, v_cache, k, v, md: PallasTritonMetadata, *, layer):
        """See `AttentionBackend.write_kv`: the in-place Pallas write."""
        kc, vc, li, one_layer = stacked_cache(k_cache, v_cache, layer)
        kc, vc = kvu.write_kv_pallas(kc, vc, k, v, md.slot_mapping, li, interpret=self.interpret)
        return (kc[0], vc[0]) if one_layer else (kc, vc)

    def attention(self, q, k_cache, v_cache, md: PallasTritonMetadata, *, layer, sm_scale: float,
                  sliding_window=None):
        """See `AttentionBackend.attention`. Raises ValueError when q does not fit the cache."""
        return rpa.ragged_paged_attention(
            *tiled_kernel_args(q, k_cache, v_cache, md, layer, self.block_size),
            sm_scale=float(sm_scale), block_q=md.block_q, pages_per_chunk=self.pages_per_chunk,
            num_warps=choose_num_warps(md.block_q * rpa.next_pow2(self.num_queries_per_kv),
                                       self.head_dim, self.dtype),
            interpret=self.interpret, sliding_window=sliding_window)
