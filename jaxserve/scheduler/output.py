"""The scheduler's plan for one step: frozen, so the runner cannot change it.

`Scheduler.schedule()` returns one `SchedulerOutput`; the runner's
`jaxserve.worker.input_batch.build_batch` turns it into the padded NumPy arrays of the step.
The plan is all the runner reads (vLLM V1's `SchedulerOutput`): the rows, the
requests the runner has not seen since they (re)started (`NewRequestData`, whose
state the runner keeps and extends with the tokens it samples), and the grammar
bitmask of the structured-output rows (`GrammarOutput`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

if TYPE_CHECKING:
    from jaxserve.sampling_params import SamplingParams




# The input id of a decode row planned before the token it reads was sampled (async
# scheduling with output placeholders, issue 24; vLLM's placeholder token): the runner
# takes that token from the previous step's sampled ids on the device.
PLACEHOLDER_TOKEN_ID = -1


@dataclass(slots=True)
class ScheduledRequest:
    """What one request computes in this step (one row of the batch).

    Fields:
      request_id: the request.
      token_ids: the tokens whose KV is computed this step, in order; a decode
        step has one, a (chunk of a) prefill or a recompute after preemption
        has more. token_ids[i] sits at position start_pos + i. A decode row planned
        ahead of the step that samples its input has `PLACEHOLDER_TOKEN_ID` there.
      start_pos: num_computed_tokens before this step.
      block_ids: the request's whole block-table row after this step's
        allocation (covers positions 0 .. start_pos + len(token_ids) - 1).
      sample: True iff after this step num_computed_tokens == num_tokens (counting the
        tokens still on their way, `Request.num_output_placeholders`), i.e. the logits
        of the last token are sampled. A non-final prefill chunk or
        recompute chunk has sample=False and produces no token.
      output_pos: num_output_tokens before this step, counting the tokens of rows planned
        but not yet sampled (`Request.num_output_placeholders`) = the output index the
        sampled token will get (the sampler's random key derives from it).

    Treated as immutable. Slotted and not frozen: the scheduler makes one per row per step,
    and a frozen dataclass's __init__ pays one object.__setattr__ a field (~2x the cost).
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_ids: tuple[int, ...]
    sample: bool
    output_pos: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_pos(self) -> int:
        """num_computed_tokens after this step (= seq_len of the row)."""
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """A request the runner has not seen since it (re)started running (vLLM's
    `NewRequestData`): sent once, in the first plan that schedules it after admission
    or after a preemption; the runner keeps it, appends each token it samples for it,
    drops it when a plan lists the request in `finished_ids` or `preempted_ids`, and
    replaces it when new data for the same id comes (a request preempted outside
    `schedule()`, by `fail_step` or `retract_running`, is in no `preempted_ids`: its old
    copy stays until it is resent or finishes).

    Fields:
      request_id: the request.
      prompt_token_ids: the prompt (the request's own immutable tuple).
      sampling_params: how to sample.
      seed: the resolved seed (`Request.seed`).
      eos_token_ids: the model's EOS ids (min_tokens suppresses them).
      logprob_start: first prompt index to score, or None (`Request.logprob_start`).
      output_token_ids: the outputs so far: empty for a new request, the kept
        outputs for one resumed after a preemption (it recomputes them).
      lora_slot: the device slot of the request's LoRA adapter (0: base model).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: "SamplingParams"
    seed: int
    eos_token_ids: tuple[int, ...]
    logprob_start: int | None
    output_token_ids: tuple[int, ...]
    lora_slot: int = 0

    @classmethod
    def from_request(cls, req: Any) -> "NewRequestData":
        """The data of a `jaxserve.scheduler.request.Request` (its outputs copied)."""
        return cls(req.request_id, req.prompt_token_ids, req.sampling_params, req.seed,
                   req.eos_token_ids, req.logprob_start, tuple(req.output_token_ids),
                   getattr(req, "lora_slot", 0))


@dataclass(frozen=True)
class GrammarOutput:
    """The allowed-token bitmask of a step's structured-output rows (vLLM's
    `GrammarOutput`), filled from each request's grammar matcher when the plan is made.

    Fields:
      request_ids: the rows that sample under a grammar, in plan order.
      bitmask: i32[len(request_ids), ceil(V/32)]; bit t of row i set = token t allowed.
      errors: request_id -> message for a row whose grammar allows no token (or whose
        matcher failed); the runner fails that row alone.
    """

    request_ids: tuple[str, ...]
    bitmask: np.ndarray
    errors: dict[str, str] = field(default_factory=dict)

    def rows(self) -> dict[str, np.ndarray]:
        """request_id -> its bitmask row i32[ceil(V/32)]."""
        return dict(zip(self.request_ids, self.bitmask))


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
      scheduled_new_reqs: the data of every scheduled request the runner has not
        seen since it (re)started (`NewRequestData`).
      grammar: the bitmask of the rows sampling under a grammar, or None.

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
    scheduled_new_reqs: tuple[NewRequestData, ...] = ()
    grammar: GrammarOutput | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def make_grammar_output(rows: list[tuple[str, Any]]) -> GrammarOutput | None:
    """The bitmask of `rows`, (request_id, `GrammarMatcher`) pairs of the rows that
    sample under a grammar in plan order; None when there are none. A matcher whose
    `fill_bitmask` raises (`GrammarDeadEnd`: no token allowed) leaves its row all
    zero and its message in `errors`, so that row alone fails."""
    if not rows:
        return None
    bitmask = np.zeros((len(rows), rows[0][1].bitmask_words), np.int32)
    errors: dict[str, str] = {}
    for i, (rid, matcher) in enumerate(rows):
        try:
            matcher.fill_bitmask(bitmask[i])
        except Exception as e:  # this row fails alone, in the runner
            errors[rid] = f"{type(e).__name__}: {e}"
    return GrammarOutput(tuple(rid for rid, _ in rows), bitmask, errors)


def align_sampled(out: SchedulerOutput, sampled_token_ids: Mapping[str, int] | Sequence[int],
                  live: Mapping[str, Any]) -> Sequence[int | None]:
    """The sampled token of each row of `out`, aligned with its rows: from a mapping
    request_id -> token (rows with sample=False, or whose request is no longer in
    `live`, get None) or a sequence already indexed by row.

    Raises:
      ValueError: a live sampling row without a token, or a sequence shorter than the rows.
    """
    rows = out.scheduled
    if not isinstance(sampled_token_ids, Mapping):
        if len(sampled_token_ids) < len(rows):
            raise ValueError(f"{len(sampled_token_ids)} sampled tokens for {len(rows)} rows")
        return sampled_token_ids
    toks: list[int | None] = []
    for i, sr in enumerate(rows):
        tok = None
        if sr.sample and sr.request_id in live:
            try:
                tok = sampled_token_ids[sr.request_id]
            except KeyError:
                raise ValueError(f"no sampled token for request {sr.request_id!r} "
                                 f"(row {i}, sample=True)") from None
        toks.append(tok)
    return toks
