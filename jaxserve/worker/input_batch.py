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
from jaxserve.scheduler.output import (PLACEHOLDER_TOKEN_ID, NewRequestData, ScheduledRequest,
                                       SchedulerOutput)
from jaxserve.sample.metadata import (SamplingMetadata, SamplingRow, make_sampling_metadata,
                                      uses_penalties)
from jaxserve.worker.runner import RowError, SampledToken


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
                 "lora_slot", "slot", "num_blocks", "last_block")

    def __init__(self, new: NewRequestData):
        self.request_id, self.prompt_token_ids = new.request_id, new.prompt_token_ids
        self.sampling_params, self.seed = new.sampling_params, new.seed
        self.eos_token_ids, self.logprob_start = new.eos_token_ids, new.logprob_start
        self.output_token_ids = list(new.output_token_ids)
        self.num_computed_tokens = 0
        self.lora_slot = new.lora_slot
        self.slot = 0  # its row of `RequestStates.block_table` (0: none yet)
        self.num_blocks = 0  # block ids written there
        self.last_block = 0  # the last of them (`RequestStates.update`'s unchanged-row check)

    def append(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def truncate(self, num_outputs: int) -> None:
        """Drop outputs past `num_outputs` (the engine did not keep them)."""
        del self.output_token_ids[num_outputs:]


class RequestStates(dict):
    """request_id -> `CachedRequestState` of every request the runner has running.

    Also the persistent block table (vLLM's `InputBatch.block_table`): `block_table`
    i32[slots, P] holds each running request's block ids in its own row (`slot`), kept
    across steps; a plan writes only the blocks a row gained (a decode step adds one block
    per row every `block_size` tokens), so laying out a step costs O(rows + new blocks),
    not O(every block held). Row 0 stays zero (the padding rows' table).

    Args:
      max_blocks_per_seq: P, the table's width; None keeps no table (`build_batch`
        then reads every row's blocks from the plan).
    """

    def __init__(self, max_blocks_per_seq: int | None = None):
        super().__init__()
        self.num_scoring = 0  # states with a logprob_start (`scoring_plan` skips without)
        self.num_penalised = 0  # states whose sampling reads their outputs (penalties)
        self.num_logprobs = 0  # states that asked for logprobs (their tokens' top-k read)
        self.block_table = None if max_blocks_per_seq is None else np.zeros(
            (16, max_blocks_per_seq), np.int32)
        self._free_slots = list(range(15, 0, -1))

    def plan_ahead_ok(self) -> bool:
        """No request held whose sampling reads its outputs on the host (penalties) or
        that scores its prompt: a plan made ahead of the last step's tokens can run."""
        return not self.num_penalised and not self.num_scoring

    def _drop(self, rid: str) -> None:
        st = self.pop(rid, None)
        if st is not None and st.logprob_start is not None:
            self.num_scoring -= 1
        if st is not None and _penalised(st.sampling_params):
            self.num_penalised -= 1
        if st is not None and _wants_logprobs(st.sampling_params):
            self.num_logprobs -= 1
        if st is not None and st.slot:
            self.block_table[st.slot, :st.num_blocks] = 0
            self._free_slots.append(st.slot)

    def _slot(self) -> int:
        if not self._free_slots:  # double the table
            n, P = self.block_table.shape
            self.block_table = np.concatenate([self.block_table, np.zeros((n, P), np.int32)])
            self._free_slots = list(range(2 * n - 1, n - 1, -1))
        return self._free_slots.pop()

    def _sync_blocks(self, st: CachedRequestState, ids) -> None:
        """Make st's table row hold `ids` (clipped to P; build_batch rejects a longer
        list), writing only the new tail when the known prefix is unchanged (`update`
        skips the call for a row whose blocks did not change)."""
        k = st.num_blocks
        n = min(len(ids), self.block_table.shape[1])
        if not st.slot:
            st.slot = self._slot()
        table = self.block_table
        if n < k or (k and st.last_block != ids[k - 1]):  # not an extension
            table[st.slot, :k] = 0
            k = 0
        if n == k + 1:  # a decode row's next block: an item write (~4x cheaper than a slice)
            table[st.slot, k] = ids[k]
        else:
            table[st.slot, k:n] = ids[k:n]
        st.num_blocks = n
        st.last_block = ids[n - 1] if n else 0

    def update(self, out: SchedulerOutput) -> tuple[list[CachedRequestState | None], dict[str, str]]:
        """Apply a plan: drop its finished and preempted requests, add its new ones; return
        each row's state (in plan order; None for a row that has none) and
        request_id -> message for the rows the runner cannot serve (no state, or fewer
        outputs than the plan's `output_pos`). A state with more outputs than
        `output_pos` is cut back to it (tokens the engine did not keep). A row planned
        ahead (its input a `PLACEHOLDER_TOKEN_ID`) finds its state one output short (the
        step before's token, not fetched yet): a placeholder is appended, which `record`
        overwrites. With a block table, each served row's table row is brought up to its
        plan's block ids."""
        for rid in out.finished_ids:
            self._drop(rid)
        for rid in out.preempted_ids:
            self._drop(rid)
        for new in out.scheduled_new_reqs:
            self._drop(new.request_id)
            self[new.request_id] = CachedRequestState(new)
            self.num_scoring += new.logprob_start is not None
            self.num_penalised += _penalised(new.sampling_params)
            self.num_logprobs += _wants_logprobs(new.sampling_params)
        rows: list[CachedRequestState | None] = []
        errors: dict[str, str] = {}
        tables = self.block_table is not None
        get, sync = self.get, self._sync_blocks
        for sr in out.scheduled:
            st = get(sr.request_id)
            if st is not None and (n := len(st.output_token_ids)) != sr.output_pos:
                if n > sr.output_pos:
                    st.truncate(sr.output_pos)
                elif n == sr.output_pos - 1 and sr.token_ids[-1] == PLACEHOLDER_TOKEN_ID:
                    st.append(PLACEHOLDER_TOKEN_ID)
                else:
                    errors[sr.request_id] = (f"the runner holds {n} outputs of "
                                             f"{sr.request_id!r}, the plan {sr.output_pos}")
                    st = None
            elif st is None:
                errors[sr.request_id] = (f"request {sr.request_id!r} is not among the runner's "
                                         "requests (no NewRequestData in any plan)")
            if st is not None:
                st.num_computed_tokens = sr.start_pos + len(sr.token_ids)
                if tables:
                    ids = sr.block_ids  # unchanged since the last step: nothing to write
                    if not (st.slot and len(ids) == st.num_blocks
                            and (not ids or ids[-1] == st.last_block)):
                        sync(st, ids)
            rows.append(st)
        return rows, errors

    def table_rows(self, states: list[CachedRequestState | None]) -> np.ndarray | None:
        """i32[S]: each row's table slot, for `build_batch(slots=...)`; None without a
        table or when a row has no state (the plan's own block ids are laid out then)."""
        if self.block_table is None or any(st is None for st in states):
            return None
        return np.fromiter((st.slot for st in states), np.int32, len(states))

    def record(self, rows: tuple[ScheduledRequest, ...], sampled: dict) -> None:
        """Store each sampling row's token (`sampled`: request_id -> SampledToken) at its
        `output_pos`: appended, or over the placeholder a plan made ahead put there."""
        for sr in rows:
            t = sampled.get(sr.request_id) if sr.sample else None
            st = self.get(sr.request_id)
            if st is not None and isinstance(t, SampledToken):
                o, p = st.output_token_ids, sr.output_pos
                if p < len(o):
                    o[p] = t.token_id
                else:
                    o.append(t.token_id)


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


def _step_block_table(rows, n_blocks: np.ndarray, S_pad: int, P: int,
                      table: np.ndarray | None, slots: np.ndarray | None) -> np.ndarray:
    """i32[S_pad, P]: the step's block table, gathered from the persistent `table` at
    `slots` when given (padding rows gather its zero row 0), else laid out from every
    row's block ids."""
    if slots is not None:
        padded = np.zeros(S_pad, np.int32)
        padded[:len(rows)] = slots
        return table[padded]
    block_table = np.zeros((S_pad, P), np.int32)
    total_blocks = int(n_blocks.sum())
    if total_blocks:
        flat = np.fromiter(itertools.chain.from_iterable(r.block_ids for r in rows), np.int32,
                           total_blocks)
        row_of = np.repeat(np.arange(len(rows)), n_blocks)
        col = np.arange(total_blocks) - np.repeat(np.cumsum(n_blocks) - n_blocks, n_blocks)
        block_table[row_of, col] = flat
    return block_table


def build_batch(out: SchedulerOutput, *, block_size: int, max_blocks_per_seq: int,
                table: np.ndarray | None = None, slots: np.ndarray | None = None
                ) -> BatchArrays:
    """Build the padded arrays of one step.

    Args:
      out: the plan; its token_bucket / seq_bucket give (T_pad, S_pad). An
        empty plan gives an all-padding batch (used for warm-up).
      block_size: B, tokens per KV block.
      max_blocks_per_seq: P, width of block_table (ceil(max_model_len / B)).
      table / slots: the persistent block table (`RequestStates.block_table`, i32[N, P],
        row 0 zero) and each plan row's slot in it (i32[S], `RequestStates.table_rows`):
        the step's block_table is gathered from it instead of laid out from every row's
        block ids (same array).

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

    block_table = _step_block_table(rows, n_blocks, S_pad, max_blocks_per_seq, table, slots)

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


def _wants_logprobs(p) -> bool:
    """Whether a row's tokens carry their top-k alternatives to the output processor."""
    return p is not None and p.logprobs is not None


def _penalised(p) -> bool:
    """Whether a row's sampling reads its past outputs (penalties), so it cannot be
    planned before its last token is back."""
    return p is not None and uses_penalties(p)


def plan_sampling_metadata(out: SchedulerOutput, states: list[CachedRequestState | None], *,
                           max_model_len: int, vocab_size: int
                           ) -> tuple[SamplingMetadata, dict[str, RowError]]:
    """Sampling arrays [S_pad] for the plan's rows (`states`: each row's runner state, None
    for a row already failed); a row that cannot be written fails alone (as does a row
    whose grammar allows nothing: `out.grammar.errors`), returned as request_id ->
    `RowError`.

    The whole batch is built in one call; only when that raises is each
    row tried by itself, and the failing ones become padding rows.
    """
    M, V = max_model_len, vocab_size
    masks = out.grammar.rows() if out.grammar is not None else {}
    errors = {rid: RowError(msg) for rid, msg in
              (out.grammar.errors.items() if out.grammar is not None else ())}
    rows: list[SamplingRow | None] = [  # (positional: one per row per step)
        None if r is None or sr.request_id in errors else SamplingRow(
            r.sampling_params, r.seed, sr.output_pos, r.prompt_token_ids, r.output_token_ids,
            r.eos_token_ids, masks.get(sr.request_id) if masks and sr.sample else None)
        for sr, r in zip(out.scheduled, states)]
    try:
        return make_sampling_metadata(rows, num_rows=out.seq_bucket, max_model_len=M,
                                      vocab_size=V), errors
    except Exception:  # find the rows at fault; the rest of the batch goes on
        pass
    for i, sr in enumerate(out.scheduled):
        try:
            make_sampling_metadata([rows[i]], num_rows=1, max_model_len=M, vocab_size=V)
        except Exception as e:
            errors[sr.request_id] = RowError(f"{type(e).__name__}: {e}")
            rows[i] = None
    return make_sampling_metadata(rows, num_rows=out.seq_bucket, max_model_len=M,
                                  vocab_size=V), errors
