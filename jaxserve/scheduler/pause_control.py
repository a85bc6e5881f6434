"""The scheduler's calls for pausing between steps (issue 28) and for taking back a
step that async scheduling dispatched ahead (issue 24): `Scheduler` inherits them."""

from __future__ import annotations

from typing import Any

from jaxserve.scheduler.output import SchedulerOutput
from jaxserve.scheduler.request import RequestStatus

_RUNNING = RequestStatus.RUNNING


class PauseControl:
    """Mixin of `jaxserve.scheduler.scheduler.Scheduler` (its `requests`, `running`,
    `waiting`, `_pending_out` and `_preempt`)."""

    def unschedule(self, out: SchedulerOutput) -> None:
        """Take back the pending plan `out` as if it had not run (async scheduling drops a
        step in flight before a pause): each running row goes back to its start_pos, its
        blocks kept for the rerun; a request the plan admitted goes back to the front of
        the waiting queue, its blocks freed. (A request the plan preempted stays
        preempted: the dropped step may have written its freed blocks.)"""
        if out is not self._pending_out:
            return
        self._pending_out = None
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
