"""Runner side: the requests the runner keeps, and a `SchedulerOutput` flattened
into the step's padded NumPy arrays.

`RequestStates` is the runner's own copy of each running request (vLLM's
`CachedRequestState`): filled from the plan's `NewRequestData`, extended with the
tokens the runner samples, dropped when the plan reports the request finished or
preempted. So `execute(plan)` reads the plan and nothing of the scheduler's.

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

from jaxserve.scheduler.request import TokenCounts
from jaxserve.scheduler.output import NewRequestData, ScheduledRequest, SchedulerOutput
from jaxserve.worker.runner import SampledToken


class CachedRequestState(TokenCounts):
    """The runner's copy of one running request (vLLM's `CachedRequestState`).

    Attributes:
      request_id, prompt_token_ids (tuple), sampling_params, seed, eos_token_ids,
      logprob_start: as in the plan's `NewRequestData`.
      output_token_ids: list of the outputs so far (the kept ones, then each token
        the runner sampled).
      num_computed_tokens: the row's KV length after the current plan (`end_pos`).
      lora_slot: the row's LoRA slot (0: base model).
    """

    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "seed",
                 "eos_token_ids", "logprob_start", "output_token_ids", "num_computed_tokens",
                 "lora_slot")

    def __init__(self, new: NewRequestData):
        self.request_id, self.prompt_token_ids = new.request_id, new.prompt_token_ids
        self.sampling_params, self.seed = new.sampling_params, new.seed
        self.eos_token_ids, self.logprob_start = new.eos_token_ids, new.logprob_start
        self.output_token_ids = list(new.output_token_ids)
        self.num_computed_tokens = 0
        self.lora_slot = new.lora_slot

    def append(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def truncate(self, num_outputs: int) -> None:
        """Drop outputs past `num_outputs` (the engine did not keep them)."""
        del self.output_token_ids[num_outputs:]


class RequestStates(dict):
    """request_id -> `CachedRequestState` of every request the runner has running."""

    def update(self, out: SchedulerOutput) -> tuple[list[CachedRequestState | None], dict[str, str]]:
        """Apply a plan: drop its finished and preempted requests, add its new ones; return
        each row's state (in plan order; None for a row that has none) and
        request_id -> message for the rows the runner cannot serve (no state, or fewer
        outputs than the plan's `output_pos`). A state with more outputs than
        `output_pos` is cut back to it (tokens the engine did not keep)."""
        for rid in out.finished_ids:
            self.pop(rid, None)
        for rid in out.preempted_ids:
            self.pop(rid, None)
        for new in out.scheduled_new_reqs:
            self[new.request_id] = CachedRequestState(new)
        rows: list[CachedRequestState | None] = []
        errors: dict[str, str] = {}
        for sr in out.scheduled:
            st = self.get(sr.request_id)
            if st is not None and len(st.output_token_ids) != sr.output_pos:
                if len(st.output_token_ids) > sr.output_pos:
                    st.truncate(sr.output_pos)
                else:
                    errors[sr.request_id] = (f"the runner holds {len(st.output_token_ids)} "
                                             f"outputs of {sr.request_id!r}, the plan "
                                             f"{sr.output_pos}")
                    st = None
            elif st is None:
                errors[sr.request_id] = (f"request {sr.request_id!r} is not among the runner's "
                                         "requests (no NewRequestData in any plan)")
            if st is not None:
                st.num_computed_tokens = sr.end_pos
            rows.append(st)
        return rows, errors

    def record(self, rows: tuple[ScheduledRequest, ...], sampled: dict) -> None:
        """Append each sampling row's token (`sampled`: request_id -> SampledToken)."""
        for sr in rows:
            t = sampled.get(sr.request_id) if sr.sample else None
            st = self.get(sr.request_id)
            if st is not None and isinstance(t, SampledToken):
                st.append(t.token_id)


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


def token_lora_slots(out: SchedulerOutput, states: list, token_bucket: int) -> np.ndarray:
    """i32[T_pad]: each token's LoRA slot, its row's `lora_slot` (issue 27); 0 for
    padding and for rows without state (they fail alone)."""
    slots = np.zeros(token_bucket, np.int32)
    q = np.fromiter((len(r.token_ids) for r in out.scheduled), np.int64, len(out.scheduled))
    per_row = np.fromiter((0 if st is None else st.lora_slot for st in states), np.int32,
                          len(states))
    slots[:int(q.sum())] = np.repeat(per_row, q)
    return slots
