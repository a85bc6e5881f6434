"""What every attention backend shares: the common step metadata, the protocol, host tiling.

The runner fills one `CommonAttentionMetadata` per step (host NumPy, bucket
shapes) and hands it to its backend's `prepare`, which returns that backend's
own metadata pytree (its tiling plus the common fields it reads); the step
then calls the backend's `write_kv` and `attention` once per layer. The split
follows vLLM V1's `CommonAttentionMetadata` / per-backend metadata builders.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.attention.kernels.tiling import NO_WINDOW, window_scalar  # noqa: F401 - re-exported


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["slot_mapping", "query_start_loc", "seq_lens", "block_table",
                                "num_seqs"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class CommonAttentionMetadata:
    """The step's paged-attention inputs, whatever the backend. T = T_pad, S = S_pad."""

    slot_mapping: np.ndarray  # i32[T] page * block_size + offset; padding -> null block 0
    query_start_loc: np.ndarray  # i32[S + 1] exclusive prefix sum of the query lengths
    seq_lens: np.ndarray  # i32[S] KV length after this step; 0 for padded slots
    block_table: np.ndarray  # i32[S, P] page ids; padding -> 0 (the null block)
    num_seqs: np.ndarray  # i32[] real sequences (<= S); slots past it are padding


# A backend's own metadata type (a registered dataclass with NumPy leaves on the host).
MdT = TypeVar("MdT")


class AttentionBackend(Protocol[MdT]):
    """One ragged paged-attention implementation, chosen once when the runner is built.

    Caches are the stacked [L, N, B, K, D] pair with `layer` a traced i32 scalar, or
    one layer's [N, B, K, D] with `layer=None`.
    """

    name: str  # "xla" | "pallas_triton" | (issue 16) "pallas_mosaic"

    def prepare(self, common: CommonAttentionMetadata) -> MdT:
        """Host side (NumPy in, NumPy pytree out): validate and tile one step."""
        ...

    def write_kv(self, k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array,
                 md: MdT, *, layer: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        """Scatter the step's new rows k, v [T, K, D] into the paged cache; returns the caches."""
        ...

    def attention(self, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, md: MdT, *,
                  layer: jax.Array | None, sm_scale: float,
                  sliding_window: jax.Array | int | None = None) -> jax.Array:
        """Causal ragged paged attention of q [T, H, D]; [T, H, D] in q.dtype, padding rows 0.

        `sliding_window` (data: an i32 scalar, traced or not; None = no window): a query
        at position p sees only keys at positions > p - sliding_window (Mistral's and
        Gemma's local attention, transformers' `kv_idx > q_idx - sliding_window`); KV
        pages wholly before that are not read.
        """
        ...


def sliding_window_start(pos0: jax.Array, window: jax.Array) -> jax.Array:
    """i32: the first key position any query at or after position pos0 sees under the
    window (pos0 - window + 1, at least 0); KV chunks wholly before it are skipped."""
    return jnp.maximum(pos0 - window + 1, 0)


def host_common(common: CommonAttentionMetadata, block_size: int) -> CommonAttentionMetadata:
    """`common` with i32 NumPy leaves, validated.

    The query at flat index t of sequence s sits at position
    seq_lens[s] - q_len[s] + (t - query_start_loc[s]).

    Raises:
      ValueError: inconsistent shapes, num_seqs outside [0, S], a bad block_size,
        query_start_loc not a prefix sum within T, seq_lens shorter than the queries
        or longer than the block table can hold.
    """
    c = CommonAttentionMetadata(
        slot_mapping=np.asarray(common.slot_mapping, np.int32),
        query_start_loc=np.asarray(common.query_start_loc, np.int32),
        seq_lens=np.asarray(common.seq_lens, np.int32),
        block_table=np.asarray(common.block_table, np.int32),
        num_seqs=np.asarray(common.num_seqs, np.int32).reshape(()))
    qsl, seq_lens, num_seqs = c.query_start_loc, c.seq_lens, int(c.num_seqs)
    t, s = c.slot_mapping.shape[0], seq_lens.shape[0]
    if c.slot_mapping.ndim != 1 or qsl.shape != (s + 1,) or c.block_table.ndim != 2 \
            or c.block_table.shape[0] != s:
        raise ValueError(f"inconsistent shapes: slot_mapping={c.slot_mapping.shape} "
                         f"query_start_loc={qsl.shape} seq_lens={seq_lens.shape} "
                         f"block_table={c.block_table.shape}")
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
    cap = c.block_table.shape[1] * block_size
    if np.any(seq_lens > cap):
        raise ValueError(f"seq_lens max={seq_lens.max()} exceeds max_blocks_per_seq * "
                         f"block_size={cap}")
    return c


def real_q_lens(common: CommonAttentionMetadata) -> np.ndarray:
    """i32[S] query tokens of each sequence slot; 0 for slots past num_seqs."""
    s = common.seq_lens.shape[0]
    return np.where(np.arange(s) < common.num_seqs, np.diff(common.query_start_loc), 0)


def num_query_tiles(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Static upper bound on the number of query tiles of a (T_pad, S_pad) bucket.

    A sequence of q tokens uses ceil(q / block_q) tiles, so the total is at most
    T / block_q + (number of sequences with q > 0), and at most T (>= 1 token per tile).
    """
    return max(1, min(num_tokens, -(-num_tokens // block_q) + min(num_seqs, num_tokens)))


def query_tiles(query_start_loc: np.ndarray, seq_lens: np.ndarray, q_lens: np.ndarray,
                block_q: int, num_tiles: int) -> dict[str, np.ndarray]:
    """Split each sequence's new tokens into tiles of at most `block_q` tokens (host, NumPy).

    Args:
      query_start_loc: i32[S+1] exclusive prefix sum of the query lengths.
      seq_lens: i32[S] KV length after this step.
      q_lens: i32[S] query tokens to tile per sequence (0 = skip this sequence).
      block_q: tokens per tile.
      num_tiles: static size of the returned arrays (see `num_query_tiles`).

    Returns:
      dict of i32 arrays: `tile_seq[NT]` (sequence of the tile), `tile_q_start[NT]`
      (flat index of its first token), `tile_pos0[NT]` (absolute position of its first
      token), `tile_kv_end[NT]` (1 + position of its last real token, i.e. how many
      keys the tile needs; 0 for unused tiles), `tile_offset[S]` (first tile of each
      sequence), and `num_tiles[1]` (tiles in use).

    Raises:
      ValueError: more tiles are needed than `num_tiles`.
    """
    q_lens = np.asarray(q_lens, np.int64)
    per_seq = -(-q_lens // block_q)  # [S]
    total = int(per_seq.sum())
    if total > num_tiles:
        raise ValueError(f"query tiles needed={total} exceed num_tiles={num_tiles}")
    offset = np.zeros_like(per_seq)
    offset[1:] = np.cumsum(per_seq)[:-1]
    seq = np.repeat(np.arange(len(q_lens)), per_seq)  # [total]
    j = np.arange(total) - offset[seq]  # tile index within its sequence
    qsl = np.asarray(query_start_loc, np.int64)
    sl = np.asarray(seq_lens, np.int64)
    pos0 = sl[seq] - q_lens[seq] + j * block_q
    rows = np.minimum(block_q, q_lens[seq] - j * block_q)

    def pad(x):
        out = np.zeros(num_tiles, np.int32)
        out[:total] = x
        return out

    return dict(tile_seq=pad(seq), tile_q_start=pad(qsl[seq] + j * block_q),
                tile_pos0=pad(pos0), tile_kv_end=pad(pos0 + rows),
                tile_offset=offset.astype(np.int32), num_tiles=np.array([total], np.int32))


def tile_step(common: CommonAttentionMetadata, block_q: int
              ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The query tiles of one validated step and where each token's output lands.

    Shared by the Pallas backends, whose kernels write [NT * block_q] tiled rows.

    Returns:
      (tiles, token_out_row): `query_tiles`' dict at the static bound
      `num_query_tiles(T, S, block_q)`, and i32[T] the row tile * block_q + r of each
      real token (-1 for padding tokens).

    Raises:
      ValueError: from `query_tiles` when the static tile bound is exceeded.
    """
    qsl = np.asarray(common.query_start_loc, np.int64)
    t, s = common.slot_mapping.shape[0], common.seq_lens.shape[0]
    til = query_tiles(qsl, common.seq_lens, real_q_lens(common), block_q,
                      num_query_tiles(t, s, block_q))
    tok = np.arange(t)
    seq_of = np.clip(np.searchsorted(qsl, tok, side="right") - 1, 0, s - 1)  # [T]
    within = tok - qsl[seq_of]
    row = (til["tile_offset"][seq_of] + within // block_q) * block_q + within % block_q
    return til, np.where(tok < qsl[int(common.num_seqs)], row, -1).astype(np.int32)


def stacked_cache(k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array | None
                  ) -> tuple[jax.Array, jax.Array, jax.Array, bool]:
    """([L, N, B, K, D] caches, i32[] layer, whether the input was one layer's [N, B, K, D]).

    Raises:
      ValueError: a cache of the wrong rank for `layer`.
    """
    if layer is None:
        if k_cache.ndim != 4:
            raise ValueError(f"per-layer cache must be [N, B, K, D], got {k_cache.shape}")
        return k_cache[None], v_cache[None], jnp.int32(0), True
    if k_cache.ndim != 5:
        raise ValueError(f"stacked cache must be [L, N, B, K, D], got {k_cache.shape}")
    return k_cache, v_cache, jnp.asarray(layer, jnp.int32).reshape(()), False


def check_q_fits(q: jax.Array, k_cache: jax.Array, block_size: int) -> None:
    """Raise ValueError unless q [T, H, D] fits the stacked cache [L, N, B, K, D]."""
    _, h, d = q.shape
    if h % k_cache.shape[3] or k_cache.shape[4] != d or k_cache.shape[2] != block_size:
        raise ValueError(f"q={q.shape} does not fit cache={k_cache.shape} "
                         f"(block_size={block_size})")


@dataclasses.dataclass(frozen=True)
class TiledMetadata:
    """The array fields both Pallas kernels read (T = T_pad, S = S_pad, NT the static tile
    bound); each backend's metadata adds its static tile field and registers the pytree
    with `TILED_FIELDS` as data."""

    slot_mapping: np.ndarray  # i32[T] page * B + offset; padding -> null block 0 (KV write)
    block_table: np.ndarray  # i32[S, P] (Mosaic: P padded to whole chunks with 0)
    tile_seq: np.ndarray  # i32[NT] sequence of each tile of block_q tokens
    tile_q_start: np.ndarray  # i32[NT] flat index of the tile's first token
    tile_pos0: np.ndarray  # i32[NT] absolute position of the tile's first token
    tile_kv_end: np.ndarray  # i32[NT] keys the tile needs (1 + last real position); 0 unused
    token_out_row: np.ndarray  # i32[T] row tile * block_q + r of each token; -1 padding


TILED_FIELDS = [f.name for f in dataclasses.fields(TiledMetadata)]


def tiled_fields(common: CommonAttentionMetadata, block_table: np.ndarray,
                 block_q: int) -> dict[str, np.ndarray]:
    """`TiledMetadata`'s fields of one validated step at tile size block_q (`tile_step`).

    Raises:
      ValueError: from `query_tiles` when the static tile bound is exceeded.
    """
    til, out_row = tile_step(common, block_q)
    return dict(slot_mapping=common.slot_mapping, block_table=block_table,
                tile_seq=til["tile_seq"], tile_q_start=til["tile_q_start"],
                tile_pos0=til["tile_pos0"], tile_kv_end=til["tile_kv_end"],
                token_out_row=out_row)


def tiled_kernel_args(q: jax.Array, k_cache: Any, v_cache: Any, md: TiledMetadata,
                      layer: jax.Array | None, block_size: int) -> tuple:
    """The positional arguments both Pallas kernels take: (q, k_cache, v_cache, layer,
    block_table, tile_seq, tile_q_start, tile_pos0, tile_kv_end, token_out_row), the
    caches in their stacked [L, N, B, K, D] form (`stacked_cache`).

    Raises:
      ValueError: q [T, H, D] does not fit the cache (`check_q_fits`).
    """
    kc, vc, li, _ = stacked_cache(k_cache, v_cache, layer)
    check_q_fits(q, kc, block_size)
    return (q, kc, vc, li, md.block_table, md.tile_seq, md.tile_q_start, md.tile_pos0,
            md.tile_kv_end, md.token_out_row)

