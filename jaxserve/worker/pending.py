"""`ModelRunner.dispatch`'s handle on a launched step (issue 24: async scheduling)."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from jaxserve.scheduler.output import SchedulerOutput
from jaxserve.worker.runner import NO_TOP_IDS, NO_TOP_LOGPROBS, RowError, RowResult, SampledToken
from jaxserve.worker.scoring import merge_scores, split_scores

if TYPE_CHECKING:
    from jaxserve.worker.model_runner import ModelRunner


class ModelPending:
    """A step whose programs are launched (JAX dispatches asynchronously); `result()`
    waits for them, copies the sampled tokens to the host and records them in the
    runner's `RequestStates` (`jaxserve.worker.runner.PendingStep`).

    Args:
      runner: the `ModelRunner` that launched it.
      out: the step's plan.
      results: the rows already decided on the host (`RowError`s), filled in place.
      plan: the step's `ScoringPlan`, or None.
      launched: `ModelRunner.launch_host_batch`'s device arrays; None when nothing ran.
    """

    __slots__ = ("runner", "out", "results", "plan", "launched", "tops")

    def __init__(self, runner: "ModelRunner", out: SchedulerOutput,
                 results: dict[str, RowResult], plan: Any, launched: tuple[Any, ...] | None):
        self.runner, self.out, self.results = runner, out, results
        self.plan, self.launched = plan, launched
        # Decided now: a plan made ahead may drop (preempt) a logprobs request before
        # this step's tokens are fetched, and its token here still needs its top-k.
        self.tops = bool(runner.requests.num_logprobs)

    def result(self) -> dict[str, RowResult]:
        """Raises: a device failure of the step."""
        if self.launched is None:
            return self.results
        r, out, results = self.runner, self.out, self.results
        ids, lps, top_ids, top_lps, scored = r.tp.fetch(self.launched)  # waits for the programs
        self.launched = None
        r.stats().record_step(out.token_bucket, out.seq_bucket)
        make, get = SampledToken, results.get
        if not self.tops:  # nobody reads them (`SampledToken`)
            tops = itertools.repeat(NO_TOP_IDS), itertools.repeat(NO_TOP_LOGPROBS)
        else:
            tops = list(top_ids), list(top_lps)
        # Python ints and floats, and row views, made by NumPy in one call each
        for sr, t, lp, ti, tl in zip(out.scheduled, ids.tolist(), lps.tolist(), *tops):
            if sr.sample and not isinstance(get(sr.request_id), RowError):
                results[sr.request_id] = make(t, lp, ti, tl)
        if self.plan is not None:
            merge_scores(results, split_scores(self.plan, *scored))
        r.requests.record(out.scheduled, results)
        return results
