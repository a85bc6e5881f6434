"""Runner side: flatten a `SchedulerOutput` into the step's padded NumPy arrays.

The scheduler hands over a plan (`jaxserve.scheduler.output`); laying it out
on the device's axes is the runner's job. All rows' tokens are concatenated on
one token axis (ragged batching, as in vLLM V1 and tpu-inference) and padded
to the bucket shape (T_pad, S_pad) chosen by the scheduler. Padding
conventions (shared with the model runner and the attention kernels):

  input_ids       i32[T_pad]        token ids; padding 0
  positions       i32[T_pad]        position of each token; padding 0
  slot_mapping    i32[T_pad]        block_id * B + offset; padding -> slots in null block 0
  query_start_loc i32[S_pad + 1]    exclusive prefix sum of q_lens; padded seqs repeat num_tokens
  seq_lens        i32[S_pad]        KV length after this step; 0 for padded seqs
  block_table     i32[S_pad, P]     block ids per row; padding 0 (P = max_blocks_per_seq)
  logits_indices  i32[S_pad]        flat index of each row's last token; padding 0
  num_seqs        i32[]             real rows S
  num_tokens      i32[]             real tokens T; tokens at index >= T belong to no row

Vectorised with np.repeat / np.cumsum: no Python loop over tokens. NumPy only
(no jax), so the fake runner builds the very same arrays.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from jaxserve.scheduler.output import SchedulerOutput


@dataclass(frozen=True)
class BatchArrays:
    """The host arrays of one step at bucket shape (T_pad, S_pad); see the module doc."""

    input_ids: np.ndarray  # i32[T_pad]
    positions: np.ndarray  # i32[T_pad]
    slot_mapping: np.ndarray  # i32[T_pad]
    query_start_loc: np.ndarray  # i32[S_pad + 1]
    seq_lens: np.ndarray  # i32[S_pad]
    block_table: np.ndarray  # i32[S_pad, max_blocks_per_seq]
    logits_indices: np.ndarray  # i32[S_pad]
    num_seqs: np.ndarray  # i32[] (0-d)
    num_tokens: np.ndarray  # i32[] (0-d)


def build_batch(out: SchedulerOutput, *, block_size: int, max_blocks_per_seq: int) -> BatchArrays:
    """Build the padded arrays of one step.

    Args:
      out: the plan; its token_bucket / seq_bucket give (T_pad, S_pad). An
        empty plan gives an all-padding batch (used for warm-up).
      block_size: B, tokens per KV block.
      max_blocks_per_seq: P, width of block_table (ceil(max_model_len / B)).

    Raises:
      ValueError: more tokens or rows than the buckets, a row needing more
        than max_blocks_per_seq blocks, or a row whose blocks do not cover
        its positions.
    """
    B = block_size
    T_pad, S_pad = out.token_bucket, out.seq_bucket
    rows = out.scheduled
    S = len(rows)
    if S > S_pad:
        raise ValueError(f"{S} scheduled rows exceed seq_bucket={S_pad}")
    q_lens = np.fromiter((len(r.token_ids) for r in rows), np.int64, S)  # [S]
    T = int(q_lens.sum())
    if T > T_pad:
        raise ValueError(f"{T} scheduled tokens exceed token_bucket={T_pad}")
    starts = np.fromiter((r.start_pos for r in rows), np.int64, S)  # [S]
    n_blocks = np.fromiter((len(r.block_ids) for r in rows), np.int64, S)  # [S]
    ends = starts + q_lens  # [S] seq_lens of real rows
    if S:
        i = int(np.argmax(n_blocks))
        if n_blocks[i] > max_blocks_per_seq:
            raise ValueError(f"request {rows[i].request_id!r} holds {n_blocks[i]} blocks > "
                             f"max_blocks_per_seq={max_blocks_per_seq}")
        short = np.nonzero(ends > n_blocks * B)[0]
        if short.size:
            r = rows[int(short[0])]
            raise ValueError(f"request {r.request_id!r}: {len(r.block_ids)} blocks of {B} cannot "
                             f"hold positions up to {int(ends[short[0]]) - 1}")

    cu = np.zeros(S_pad + 1, np.int32)  # [S_pad+1]
    np.cumsum(q_lens, out=cu[1:S + 1])
    cu[S + 1:] = T

    block_table = np.zeros((S_pad, max_blocks_per_seq), np.int32)  # [S_pad, P]
    total_blocks = int(n_blocks.sum())
    if total_blocks:
        flat = np.fromiter(itertools.chain.from_iterable(r.block_ids for r in rows), np.int32,
                           total_blocks)
        row_of = np.repeat(np.arange(S), n_blocks)
        col = np.arange(total_blocks) - np.repeat(np.cumsum(n_blocks) - n_blocks, n_blocks)
        block_table[row_of, col] = flat

    input_ids = np.zeros(T_pad, np.int32)
    positions = np.zeros(T_pad, np.int32)
    # Padding tokens write somewhere inside the null block 0, never into a real block.
    slot_mapping = (np.arange(T_pad) % B).astype(np.int32)
    if T:
        input_ids[:T] = np.fromiter(itertools.chain.from_iterable(r.token_ids for r in rows),
                                    np.int32, T)
        seq_of = np.repeat(np.arange(S), q_lens)  # [T] row of each token
        pos = np.arange(T) - cu[seq_of] + starts[seq_of]  # [T]
        positions[:T] = pos
        slot_mapping[:T] = block_table[seq_of, pos // B] * B + pos % B

    seq_lens = np.zeros(S_pad, np.int32)
    seq_lens[:S] = ends
    logits_indices = np.zeros(S_pad, np.int32)
    logits_indices[:S] = cu[1:S + 1] - 1
    return BatchArrays(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
                       query_start_loc=cu, seq_lens=seq_lens, block_table=block_table,
                       logits_indices=logits_indices, num_seqs=np.asarray(S, np.int32),
                       num_tokens=np.asarray(T, np.int32))
