"""Random ragged paged-attention batches with NaN-poisoned padding (tests and scripts/gpu_check.py).

A batch follows the runner's conventions: real sequences first, padded sequence slots
with q_len 0 and seq_len 0, padding tokens' slots inside the null block 0, padded
block-table entries 0, and block tables drawn from a random permutation of blocks
1..N-1 (so pages are never contiguous). Every KV slot that holds no real token
(including all of block 0) and every padding query row is NaN, so a kernel that
reads past a sequence's end or lets a padded row leak fails the comparison.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Batch:
    q: np.ndarray  # [T, H, D]
    k_cache: np.ndarray  # [N, B, K, D]
    v_cache: np.ndarray  # [N, B, K, D]
    slot_mapping: np.ndarray  # i32[T]
    query_start_loc: np.ndarray  # i32[S+1]
    seq_lens: np.ndarray  # i32[S]
    block_table: np.ndarray  # i32[S, P]
    num_seqs: int
    block_size: int

    def common_kwargs(self) -> dict:
        """The fields of a `CommonAttentionMetadata` for this batch."""
        return dict(slot_mapping=self.slot_mapping, query_start_loc=self.query_start_loc,
                    seq_lens=self.seq_lens, block_table=self.block_table,
                    num_seqs=np.int32(self.num_seqs))

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[self.num_seqs])


def random_batch(rng: np.random.Generator, *, q_lens, seq_lens, num_tokens: int, num_seqs: int,
                 max_blocks_per_seq: int, num_kv_blocks: int, block_size: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, dtype=np.float32, poison: bool = True) -> Batch:
    """Build one padded step batch at bucket shapes (num_tokens, num_seqs).

    q_lens[i] new tokens of sequence i sit at the end of its seq_lens[i] keys.
    Raises ValueError when the batch does not fit the bucket or the pool.
    """
    q_lens = np.asarray(q_lens, np.int64)
    sl = np.asarray(seq_lens, np.int64)
    n = len(q_lens)
    need = -(-sl // block_size)
    if n > num_seqs or q_lens.sum() > num_tokens or np.any(sl < q_lens) \
            or np.any(need > max_blocks_per_seq) or need.sum() > num_kv_blocks - 1:
        raise ValueError(f"batch does not fit: {q_lens=} {sl=} {num_tokens=} {num_seqs=}")
    qsl = np.full(num_seqs + 1, q_lens.sum(), np.int32)
    qsl[0] = 0
    qsl[1:n + 1] = np.cumsum(q_lens)
    seq_lens_p = np.zeros(num_seqs, np.int32)
    seq_lens_p[:n] = sl
    bt = np.zeros((num_seqs, max_blocks_per_seq), np.int32)
    perm = rng.permutation(np.arange(1, num_kv_blocks))
    used = 0
    for s in range(n):
        bt[s, :need[s]] = perm[used:used + need[s]]
        used += need[s]
    shape = (num_kv_blocks, block_size, num_kv_heads, head_dim)
    k_cache = rng.standard_normal(shape).astype(np.float32)
    v_cache = rng.standard_normal(shape).astype(np.float32)
    q = rng.standard_normal((num_tokens, num_heads, head_dim)).astype(np.float32)
    slot = np.zeros(num_tokens, np.int32)  # padding tokens -> null block 0
    live = np.zeros((num_kv_blocks, block_size), bool)
    for s in range(n):
        pos = np.arange(sl[s])
        live[bt[s, pos // block_size], pos % block_size] = True
        new = pos[sl[s] - q_lens[s]:]
        slot[qsl[s]:qsl[s + 1]] = bt[s, new // block_size] * block_size + new % block_size
    if poison:
        k_cache[~live] = np.nan
        v_cache[~live] = np.nan
        q[qsl[n]:] = np.nan
    return Batch(q=q.astype(dtype), k_cache=k_cache.astype(dtype), v_cache=v_cache.astype(dtype),
                 slot_mapping=slot, query_start_loc=qsl, seq_lens=seq_lens_p, block_table=bt,
                 num_seqs=n, block_size=block_size)


# Named ragged mixes used by the tests: (q_lens, seq_lens) with block_size 16 in mind.
def named_mixes(block_size: int, max_len: int) -> dict[str, tuple[list[int], list[int]]]:
    b = block_size
    return {
        "decode_only": ([1] * 6, [1, b - 1, b, b + 1, 3 * b, max_len]),
        "prefill_only": ([5, 40, 1 + b], [5, 40, 1 + b]),
        "chunked_prefill": ([7, 33, 2], [7 + 2 * b + 3, 33 + 5, 2 + b - 1]),
        "mixed": ([1, 1, 37, 1, 9, 1], [max_len, b + 1, 37 + 21, 1, 9, b]),
        "long_q": ([50, 1], [50 + 2 * b, 3 * b]),
    }


def load_gpu_check():
    """scripts/gpu_check.py as a module (it is a script, not part of the package)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def empty_common(num_tokens: int, num_seqs: int, pages: int):
    """An all-padding step's `CommonAttentionMetadata` (what warm-up lowers): T, S, P."""
    from jaxserve.attention import CommonAttentionMetadata

    return CommonAttentionMetadata(
        slot_mapping=np.zeros(num_tokens, np.int32),
        query_start_loc=np.zeros(num_seqs + 1, np.int32), seq_lens=np.zeros(num_seqs, np.int32),
        block_table=np.zeros((num_seqs, pages), np.int32), num_seqs=np.int32(0))
