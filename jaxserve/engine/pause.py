"""Pausing generation around a weight swap (issue 28): the four in-flight modes.

The modes follow vLLM's `pause_generation(mode="abort"|"wait"|"keep")` and
SGLang's abort / in_place / retract. The engine here steps synchronously, so a
pause always lands between two steps; `Pauser.pause` first refuses while the
scheduler still holds a plan whose sampled tokens have not come back
(`Scheduler.pending_output`), which is where an overlapped step in flight
would be waited for once async scheduling exists.
"""

from __future__ import annotations

from typing import Any, Callable

from jaxserve.scheduler.request import RequestStatus

PAUSE_MODES = ("abort", "wait", "keep", "retract")


def check_mode(mode: str) -> str:
    """Return `mode` if it is one of PAUSE_MODES; else ValueError naming it and the choices."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"unknown pause mode {mode!r}; expected one of {PAUSE_MODES}")
    return mode


class Pauser:
    """Pause state of one LLMEngine; the engine calls it, it never calls the engine's
    public API (it takes the engine's scheduler, output processor and a step function).

    Args:
      scheduler: the engine's `Scheduler`.
      outputs: the engine's `OutputProcessor`.
      step: runs one engine step and returns its `RequestOutput`s (used by "wait").
    """

    def __init__(self, scheduler: Any, outputs: Any, step: Callable[[], list]):
        self.scheduler = scheduler
        self.outputs = outputs
        self._step = step
        self.mode: str | None = None  # the mode of the current pause; None when running
        self._held: Any = None  # the waiting queue set aside by "wait"

    @property
    def paused(self) -> bool:
        return self.mode is not None

    def pause(self, mode: str, abort_message: str) -> list:
        """Pause; return the outputs the pause produced (aborted / finished requests).

        abort: fail every live request (finish_reason "error", `abort_message`).
        wait: set the waiting queue aside and step until the running requests end.
        keep: nothing to do: the running requests keep their KV.
        retract: preempt every running request by recompute (frees its KV).

        Raises:
          ValueError: unknown mode, or already paused.
          RuntimeError: a planned step's tokens have not come back yet.
        """
        check_mode(mode)
        if self.paused:
            raise ValueError(f"pause_generation({mode!r}): already paused (mode {self.mode!r})")
        sched = self.scheduler
        pending = sched.pending_output
        if pending is not None and any(sr.request_id in sched.requests
                                       for sr in pending.scheduled):
            raise RuntimeError(f"pause_generation: step {pending.step} is still in flight")
        out: list = []
        if mode == "abort":
            live = list(sched.requests)
            sched.finish_requests(live, RequestStatus.FINISHED_ERROR)
            out = self.outputs.collect(self.outputs.fail(live, abort_message))
        elif mode == "wait":
            self._held = sched.set_aside_waiting()
            while sched.num_running:
                out += self._step()
        elif mode == "retract":
            sched.retract_running()  # frees their KV; they recompute prompt + outputs later
        self.mode = mode
        return out

    def resume(self) -> None:
        """Resume scheduling; "wait" puts the set-aside queue back (anything preempted
        while draining goes first).

        Raises:
          ValueError: not paused.
        """
        if not self.paused:
            raise ValueError("resume_generation: generation is not paused")
        if self._held is not None:
            self.scheduler.restore_waiting(self._held)
            self._held = None
        self.mode = None
