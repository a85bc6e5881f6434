"""The "pallas_mosaic" attention backend: the Mosaic GPU kernel, its tiles and host metadata.

The kernel (Hopper: TMA page copies, WGMMA, an mbarrier pipeline) lives in
jaxserve/pallas/ragged_paged_attention_mosaic*.py and imports nothing from this
package (the package's `__init__` imports the registry, which imports this module).
This module picks the kernel's static tiles per (T_pad, S_pad) bucket, cuts the
step's sequences into query tiles on the host (`mosaic_metadata`), and calls the
kernel with the backend's `interpret` flag (Pallas' GPU interpreter,
`plgpu.InterpretGPUParams`, runs it on CPU for tests). The KV write is the XLA
scatter of the xla backend; why that is as good on a GPU is argued in the kernel
module's docstring. The float64 reference both are tested against is
`reference.reference_ragged_paged_attention`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.attention.common import (TILED_FIELDS, CommonAttentionMetadata, TiledMetadata,
                                      host_common, tiled_fields, tiled_kernel_args)
from jaxserve.attention.xla import XlaBackend
from jaxserve.attention.kernels import ragged_paged_attention_mosaic as rpm


@functools.partial(jax.tree_util.register_dataclass, data_fields=TILED_FIELDS,
                   meta_fields=["tiles"])
@dataclasses.dataclass(frozen=True)
class MosaicMetadata(TiledMetadata):
    """The Mosaic kernel's step metadata: `TiledMetadata`, block_table padded to a
    multiple of pages_per_chunk pages, and the static tiles."""

    tiles: rpm.MosaicTiles  # static: a new value is a new program


def mosaic_metadata(common: CommonAttentionMetadata, tiles: rpm.MosaicTiles) -> MosaicMetadata:
    """Host (NumPy) tiling of one step for the Mosaic kernel.

    Args:
      common: the step, already validated by `host_common` (i32 NumPy leaves).
      tiles: the kernel's static tiles (block_q and pages_per_chunk are used here).

    Returns:
      MosaicMetadata with NumPy leaves (one `jax.device_put` moves it). Tile i holds
      tokens tile_q_start[i] .. + block_q of sequence tile_seq[i]; token t's output
      is row token_out_row[t] of the kernel's [NT * block_q] tiled rows.

    Raises:
      ValueError: from `query_tiles` when the static tile bound is exceeded.
    """
    bt = common.block_table
    # The kernel walks whole chunks of pages; the extra columns point at the null block.
    bt = np.pad(bt, ((0, 0), (0, -bt.shape[1] % tiles.pages_per_chunk)))
    return MosaicMetadata(**tiled_fields(common, bt, tiles.block_q), tiles=tiles)


@dataclasses.dataclass(frozen=True)
class PallasMosaicBackend:
    """Ragged paged attention as the Pallas Mosaic GPU kernel (Hopper, sm_90a).

    Args:
      block_size: B, tokens per KV page (a multiple of 8; see `rpm.check_tiles`).
      num_queries_per_kv: H / K.
      head_dim: D (a multiple of 64, <= 256).
      dtype: the cache / activation dtype, "bfloat16" or "float32" (fp32 takes the
        kernel's slower bf16x3 path and may run one pipeline slot at head_dim 128).
      tiles: fixed tiles for every bucket; None picks `rpm.default_tiles` per bucket
        (decode tiles when T_pad <= 2 * S_pad, prefill tiles otherwise).
      interpret: False (compile for the GPU), True or a `plgpu.InterpretGPUParams`
        (run in Pallas' GPU interpreter on CPU; ~0.3 s per program on this CPU).

    Raises:
      ValueError: at construction, a head_dim, page size, GQA ratio or dtype the
        kernel cannot tile (the message names the value and its limit), before any
        trace or compile.
    """

    block_size: int
    num_queries_per_kv: int
    head_dim: int
    dtype: str = "bfloat16"
    tiles: rpm.MosaicTiles | None = None
    interpret: Any = False
    name: str = "pallas_mosaic"

    def __post_init__(self):
        for decode in (True, False):
            rpm.check_tiles(self.tiles_for(decode=decode),
                            num_queries_per_kv=self.num_queries_per_kv,
                            block_size=self.block_size, head_dim=self.head_dim,
                            dtype=jnp.dtype(self.dtype))

    def tiles_for(self, *, decode: bool) -> rpm.MosaicTiles:
        """The static tiles of a decode-heavy (True) or prefill-heavy bucket."""
        if self.tiles is not None:
            return self.tiles
        return rpm.default_tiles(self.num_queries_per_kv, self.block_size, head_dim=self.head_dim,
                                 dtype=jnp.dtype(self.dtype), decode=decode)

    def prepare(self, common: CommonAttentionMetadata) -> MosaicMetadata:
        """Validate the step and tile it for the kernel (host NumPy).

        The tile choice depends only on the bucket (T_pad, S_pad), so warm-up's
        all-padding batch builds the same program a real step of that bucket runs.

        Raises:
          ValueError: see `host_common`.
        """
        c = host_common(common, self.block_size)
        t, s = c.slot_mapping.shape[0], c.seq_lens.shape[0]
        return mosaic_metadata(c, self.tiles_for(decode=t <= 2 * s))

    # The xla backend's KV write (it reads only md.slot_mapping): one XLA scatter per
    # cache (at T = 1 a dynamic-update-slice, `xla.write_one_row`; not yet run on a GPU),
    # in place on the donated / scan-carried cache (kernel module docstring).
    write_kv = XlaBackend.write_kv

    def attention(self, q, k_cache, v_cache, md: MosaicMetadata, *, layer, sm_scale: float,
                  sliding_window=None):
        """See `AttentionBackend.attention`.

        Raises:
          ValueError: q does not fit the cache, or the cache is not in q's dtype (a
            `--kv_cache_dtype` other than the model's: the kernel's tiles and shared-memory
            layouts are per dtype; the xla and pallas_triton backends read 16-bit caches).
        """
        if k_cache.dtype != q.dtype:
            raise ValueError(f"attention backend 'pallas_mosaic' needs the KV cache in the "
                             f"model dtype {q.dtype}, got kv_cache_dtype={k_cache.dtype}; use "
                             f"--attention_backend=pallas_triton or xla")
        return rpm.ragged_paged_attention_mosaic(
            *tiled_kernel_args(q, k_cache, v_cache, md, layer, self.block_size),
            sm_scale=float(sm_scale), tiles=md.tiles, interpret=self.interpret,
            sliding_window=sliding_window)
