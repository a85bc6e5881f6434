"""The scheduler's calls for pausing between steps (issue 28), for taking back a step
that async scheduling dispatched ahead or that failed (issue 24), and for the prefix
cache of a plan made ahead: `Scheduler` inherits them."""

from __future__ import annotations

from typing import Any

from jaxserve.scheduler.output import SchedulerOutput
from jaxserve.scheduler.request import RequestStatus

_RUNNING = RequestStatus.RUNNING
# A request whose step fails as a whole is recomputed this many times before it fails.
MAX_STEP_RETRIES = 1


class PauseControl:
    """Mixin of `jaxserve.scheduler.scheduler.Scheduler` (its `requests`, `running`,
    `waiting`, `kv_cache_manager`, `block_size`, `_pending_out`, `_ahead_of`,
    `num_preemptions` and `finish_requests`)."""

    def fail_step(self, out: SchedulerOutput, *, kv_lost: bool) -> list[str]:
        """After a plan's execution raised: its rows are preempted by recompute to be
        retried, except a row whose lifetime budget of MAX_STEP_RETRIES is spent, which
        finishes FINISHED_ERROR; with `kv_lost` every running request is preempted too
        (a preemption, not a retry). The prefix cache is forgotten. Returns the ids failed."""
        rows = {sr.request_id for sr in out.scheduled if sr.request_id in self.requests}
        self._drop_placeholders(out)
        failed = [r for r in rows if self.requests[r].num_step_retries >= MAX_STEP_RETRIES]
        self.finish_requests(failed, RequestStatus.FINISHED_ERROR)
        for req in reversed(list(self.running)):  # newest first: push_front keeps the oldest first
            if kv_lost or req.request_id in rows:
                req.num_step_retries += req.request_id in rows
                self.running.remove(req)
                self._preempt(req)
        if self._ahead_of is out:
            self._ahead_of = None
        elif self._pending_out is out:
            self._pending_out = None
        self.kv_cache_manager.reset_prefix_cache()
        return failed

    def _drop_placeholders(self, out: SchedulerOutput) -> None:
        """The sampling rows of `out` will bring no token (the plan failed or was taken back)."""
        reqs = self.requests
        for sr in out.scheduled:
            req = reqs.get(sr.request_id) if sr.sample else None
            if req is not None and req.num_output_placeholders:
                req.num_output_placeholders -= 1

    def _commit_inputs(self, out: SchedulerOutput, defer: bool = False) -> None:
        """Register in the prefix cache the blocks the plan in flight fills, before its
        tokens are back (planning ahead): their inputs are all known, and a step that
        reads them runs after it, so the next plan gets the hits a serial loop's would
        (`update_from_output` registers the same blocks again, a no-op).

        `defer`: each row's request and its tokens known now are queued
        (`KVCacheManager.commit_later`) and registered by `commit_deferred`, which the
        engine calls once the plan being made is dispatched, or earlier by the manager
        itself before anything that could tell the difference: the same cache."""
        kv = self.kv_cache_manager
        if not kv.enable_prefix_caching:
            return
        B, reqs = self.block_size, self.requests
        todo = []
        for sr in out.scheduled:
            s = sr.start_pos
            if (s + len(sr.token_ids)) // B > s // B:
                req = reqs.get(sr.request_id)
                if req is not None and req.status is _RUNNING:
                    todo.append((req, min(req.num_computed_tokens, len(req.all_token_ids))))
        kv.commit_later(todo)
        if not defer:
            kv.flush_commits()

    def commit_deferred(self) -> None:
        """Register the blocks `_commit_inputs(defer=True)` queued (no-op when none)."""
        self.kv_cache_manager.flush_commits()

    def _preempt(self, req: Any) -> None:
        """Preempt by recompute; the caller has removed it from `running`."""
        self.kv_cache_manager.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(req)

    def unschedule(self, out: SchedulerOutput) -> None:
        """Take back the pending plan `out` as if it had not run (async scheduling drops a
        step in flight before a pause): each running row goes back to its start_pos, its
        blocks kept for the rerun; a request the plan admitted goes back to the front of
        the waiting queue, its blocks freed; its sampling rows' placeholders are dropped.
        When `out` was planned ahead (before the plan before it was applied), that plan
        is the pending one again. (A request the plan preempted stays preempted: the
        dropped step may have written its freed blocks.)"""
        if out is not self._pending_out:
            return
        self._pending_out, self._ahead_of = self._ahead_of, None  # the plan before it, if any
        self._drop_placeholders(out)
        admitted = {n.request_id for n in out.scheduled_new_reqs}
        for sr in reversed(out.scheduled):  # push_front in reverse: the queue's old order
            req = self.requests.get(sr.request_id)
            if req is None or req.status is not _RUNNING:
                continue
            if sr.request_id in admitted:
                self.running.remove(req)
                self.kv_cache_manager.free(sr.request_id)
                req.num_computed_tokens = 0
                req.status = (RequestStatus.PREEMPTED if req.num_preemptions
                              else RequestStatus.WAITING)
                self.waiting.push_front(req)
            else:
                req.num_computed_tokens = sr.start_pos

    def retract_running(self) -> list[str]:
        """Preempt every running request by recompute now, KV freed, order kept at the
        queue's front (SGLang's "retract"); returns their ids."""
        ids = []
        for req in reversed(list(self.running)):  # push_front: keep their order
            self.running.remove(req)
            self._preempt(req)
            ids.append(req.request_id)
        return ids[::-1]

    def set_aside_waiting(self) -> Any:
        """Take the waiting queue out (an empty one replaces it) until `restore_waiting`."""
        held, self.waiting = self.waiting, type(self.waiting)()
        return held

    def restore_waiting(self, held: Any) -> None:
        """Put a `set_aside_waiting` queue back: the preempted meanwhile first, the added
        meanwhile last."""
        now = [self.waiting.pop() for _ in range(len(self.waiting))]
        for req in reversed([r for r in now if r.status == RequestStatus.PREEMPTED]):
            held.push_front(req)
        for req in (r for r in now if r.status != RequestStatus.PREEMPTED):
            held.push(req)
        self.waiting = held
