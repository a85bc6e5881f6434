"""The scheduler's plan for one step: frozen, so the runner cannot change it.

`Scheduler.schedule()` returns one `SchedulerOutput`; the runner's
`jaxserve.worker.input_batch.build_batch` turns it into the padded NumPy arrays of the step.
"""

from __future__ import annotations

from dataclasses import dataclass


_new = object.__new__


@dataclass(frozen=True)
class ScheduledRequest:
    """What one request computes in this step (one row of the batch).

    Fields:
      request_id: the request.
      token_ids: the tokens whose KV is computed this step, in order; a decode
        step has one, a (chunk of a) prefill or a recompute after preemption
        has more. token_ids[i] sits at position start_pos + i.
      start_pos: num_computed_tokens before this step.
      block_ids: the request's whole block-table row after this step's
        allocation (covers positions 0 .. start_pos + len(token_ids) - 1).
      sample: True iff after this step num_computed_tokens == num_tokens, i.e.
        the logits of the last token are sampled. A non-final prefill chunk or
        recompute chunk has sample=False and produces no token.
      output_pos: num_output_tokens before this step = the output index the
        sampled token will get (the sampler's random key derives from it).
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_ids: tuple[int, ...]
    sample: bool
    output_pos: int

    @classmethod
    def make(cls, request_id: str, token_ids: tuple[int, ...], start_pos: int,
             block_ids: tuple[int, ...], sample: bool, output_pos: int) -> "ScheduledRequest":
        """Same as the constructor, ~2x cheaper (the scheduler builds one per row per step;
        a frozen dataclass __init__ pays one object.__setattr__ per field)."""
        obj = _new(cls)
        obj.__dict__.update(request_id=request_id, token_ids=token_ids, start_pos=start_pos,
                            block_ids=block_ids, sample=sample, output_pos=output_pos)
        return obj

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_pos(self) -> int:
        """num_computed_tokens after this step (= seq_len of the row)."""
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step's plan.

    Fields:
      scheduled: the rows, in batch-row order.
      num_scheduled_tokens: sum of len(token_ids) over rows (<= max_num_batched_tokens).
      token_bucket: T_pad, the padded token count (0 for an empty step).
      seq_bucket: S_pad, the padded sequence count (0 for an empty step).
      preempted_ids: requests preempted by this schedule() (their KV freed).
      finished_ids: requests finished or aborted since the previous schedule().
      step: a counter, one per schedule() call.

    An output with no rows is possible (e.g. right after a preemption); the
    runner then runs nothing.
    """

    scheduled: tuple[ScheduledRequest, ...]
    num_scheduled_tokens: int
    token_bucket: int
    seq_bucket: int
    preempted_ids: tuple[str, ...]
    finished_ids: tuple[str, ...]
    step: int

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
