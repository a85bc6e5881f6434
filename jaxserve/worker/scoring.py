"""Host side of scoring: which token rows of a step yield teacher-forced logprobs.

A request with `Request.logprob_start = j0` (prompt_logprobs: j0 = 1; `LLM.score`:
the first completion index) needs, for every prompt index j in [j0, P), the
logprob of prompt token j under the logits at position j - 1 (vLLM's
prompt_logprobs, and the teacher-forced scores RL importance ratios use). Those
positions are ordinary prefill tokens of the paged engine, so scoring is
prefill work: it batches, chunks and buckets like everything else. Per step
the runner runs one extra program over the layer stack's final-normed hidden
rows [T_pad, E] ("score", T_pad: LM head, log_softmax, the target's logprob and
the top-k), only in steps that have scoring rows; this module computes its
target ids (the next prompt token, known on the host) and cuts its [T_pad]
results back into per-request `PromptLogprobs`.

Each chunk yields the positions it computed; a re-prefill after a preemption
yields the same indices again (same values), so receivers store by index and
nothing is duplicated or lost. NumPy only: the fake runner uses it too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from jaxserve.worker.input_batch import CachedRequestState
from jaxserve.worker.runner import PromptLogprobs, SampledToken
from jaxserve.scheduler.output import ScheduledRequest, SchedulerOutput


def score_span(req: CachedRequestState, sr: ScheduledRequest) -> tuple[int, int] | None:
    """Prompt indices [a, b) whose logprobs this row's tokens give, or None.

    The row computes positions [s, s + q); index j needs position j - 1, so
    a = max(logprob_start, s + 1) and b = min(P, s + q + 1).
    """
    j0 = req.logprob_start
    if j0 is None:
        return None
    s = sr.start_pos
    a = max(j0, s + 1)
    b = min(req.num_prompt_tokens, s + len(sr.token_ids) + 1)
    return (a, b) if a < b else None


@dataclass(frozen=True)
class ScoringPlan:
    """The score program's input and how to cut its output.

    Fields:
      targets: i32[T_pad] at flat token index i, the id whose logprob row i gives
        (the next prompt token); 0 at rows nobody scores.
      spans: (request_id, a, b, flat index of position a - 1) per scoring row.
    """

    targets: np.ndarray
    spans: tuple[tuple[str, int, int, int], ...]


def scoring_plan(out: SchedulerOutput, requests: Mapping[str, CachedRequestState]
                 ) -> ScoringPlan | None:
    """The step's scoring rows (None when there are none: the score program is skipped);
    `requests`: the runner's `RequestStates`."""
    if not getattr(requests, "num_scoring", True):  # RequestStates counts its scoring rows
        return None
    spans = []
    flat = 0
    for sr in out.scheduled:
        req = requests.get(sr.request_id)
        span = score_span(req, sr) if req is not None else None
        if span is not None:
            a, b = span
            spans.append((sr.request_id, a, b, flat + a - 1 - sr.start_pos))
        flat += len(sr.token_ids)
    if not spans:
        return None
    targets = np.zeros(out.token_bucket, np.int32)
    for rid, a, b, off in spans:
        targets[off:off + b - a] = requests[rid].prompt_token_ids[a:b]
    return ScoringPlan(targets, tuple(spans))


def split_scores(plan: ScoringPlan, logprobs: np.ndarray, top_ids: np.ndarray,
                 top_logprobs: np.ndarray) -> dict[str, PromptLogprobs]:
    """Per-request results from the score program's f32[T_pad], i32/f32[T_pad, k] outputs."""
    res = {}
    for rid, a, b, off in plan.spans:
        sl = slice(off, off + b - a)
        res[rid] = PromptLogprobs(a, np.asarray(logprobs[sl], np.float32),
                                  np.asarray(top_ids[sl], np.int32),
                                  np.asarray(top_logprobs[sl], np.float32))
    return res


def fake_scores(plan: ScoringPlan, *, vocab_size: int, max_logprobs: int
                ) -> dict[str, PromptLogprobs]:
    """Hand-checkable scores for the fake runner: target t scores -0.1 * (1 + t % 5); its
    i-th alternative (i = 1..k) is (t + i) % vocab_size with logprob -(0.1 + i)."""
    t = plan.targets.astype(np.int64)
    i = np.arange(1, max_logprobs + 1)
    lp = (-0.1 * (1 + t % 5)).astype(np.float32)
    top_ids = ((t[:, None] + i[None, :]) % vocab_size).astype(np.int32)
    top_lps = np.broadcast_to(-(0.1 + i).astype(np.float32), top_ids.shape)
    return split_scores(plan, lp, top_ids, top_lps)


def merge_scores(results: dict, scores: dict[str, PromptLogprobs]) -> dict:
    """Attach each row's scores to its result: a SampledToken gets `.prompt`; a row that
    did not sample gets the PromptLogprobs itself; a failed row (RowError) stays failed."""
    for rid, pl in scores.items():
        r = results.get(rid)
        if r is None:
            results[rid] = pl
        elif isinstance(r, SampledToken):
            results[rid] = dataclasses.replace(r, prompt=pl)
    return results
