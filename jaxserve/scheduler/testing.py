"""A fake model runner: drives a Scheduler with scripted, deterministic tokens.

JetStream's habit: test the orchestration with a mock engine whose
arithmetic can be checked by hand, no model at all. `FakeRunner.step()` is one
engine iteration (schedule -> "forward" -> update_from_output); `run()` loops
it over a workload with arrival times on a simulated clock. Used by the
scheduler tests and by benchmark dry runs (bucket padding without a model).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

from jaxserve.request import Request
from jaxserve.scheduler.batch import BatchArrays, build_batch
from jaxserve.scheduler.output import SchedulerOutput
from jaxserve.scheduler.scheduler import Scheduler

TokenFn = Callable[[Request, int], int]


def default_token(request_id: str, output_pos: int, *, vocab_size: int = 1000, low: int = 3) -> int:
    """A deterministic pseudo-random token in [low, vocab_size) for (request_id, position).

    Depends on nothing else (not the batch, the step or a preemption), like
    a seeded sampler keyed on (seed, output position).
    """
    h = zlib.crc32(f"{request_id}:{output_pos}".encode())
    return low + h % (vocab_size - low)


def scripted(script: Mapping[str, Sequence[int]], fallback: TokenFn | None = None) -> TokenFn:
    """Token function that emits script[request_id][output_pos] (fallback past the end)."""
    def fn(req: Request, pos: int) -> int:
        s = script.get(req.request_id)
        if s is not None and pos < len(s):
            return s[pos]
        if fallback is None:
            raise KeyError(f"no scripted token for {req.request_id!r} at output {pos}")
        return fallback(req, pos)
    return fn


@dataclass
class StepResult:
    out: SchedulerOutput
    sampled: dict[str, int]
    finished: list[Request]
    batch: BatchArrays | None


class FakeRunner:
    """Loops `schedule()` / `update_from_output()` with deterministic tokens.

    Args:
      scheduler: the scheduler to drive.
      token_fn: (request, output_pos) -> token id; default `default_token`.
      build_batches: also build the padded arrays each step (exercises
        `build_batch` exactly as the model runner would).
      check_invariants: call `scheduler.check_invariants()` after every
        schedule() and update (slow; for tests).
      on_step: callback(StepResult) after every step.
    """

    def __init__(self, scheduler: Scheduler, *, token_fn: TokenFn | None = None,
                 build_batches: bool = False, check_invariants: bool = False,
                 on_step: Callable[[StepResult], None] | None = None):
        self.scheduler = scheduler
        self.token_fn = token_fn or (lambda req, pos: default_token(req.request_id, pos))
        self.build_batches = build_batches
        self.check = check_invariants
        self.on_step = on_step
        self.num_steps = 0
        self.finished: dict[str, Request] = {}

    def step(self) -> StepResult:
        s = self.scheduler
        out = s.schedule()
        if self.check:
            s.check_invariants()
        batch = None
        if self.build_batches and out.scheduled:
            batch = build_batch(out, block_size=s.block_size,
                                max_blocks_per_seq=s.max_blocks_per_seq)
        sampled = {}
        for sr in out.scheduled:
            if sr.sample:
                sampled[sr.request_id] = self.token_fn(s.requests[sr.request_id], sr.output_pos)
        finished = s.update_from_output(out, sampled)
        if self.check:
            s.check_invariants()
        for r in finished:
            self.finished[r.request_id] = r
        self.num_steps += 1
        res = StepResult(out, sampled, finished, batch)
        if self.on_step is not None:
            self.on_step(res)
        return res

    def run(self, arrivals: Iterable[tuple[float, Request]] = (), *, max_steps: int = 100_000,
            step_time: Callable[[SchedulerOutput], float] | float = 0.0) -> dict[str, Request]:
        """Run until every request (queued and arriving) has finished.

        Args:
          arrivals: (arrival time in simulated seconds, request) pairs; each is
            added once the clock reaches its time.
          max_steps: a livelock guard.
          step_time: simulated seconds one step takes (a constant or a
            function of the plan, e.g. a cost model of the padded shape).

        Returns: request_id -> finished Request, for everything finished so far.

        Raises:
          RuntimeError: more than max_steps steps (the scheduler did not finish).
        """
        pending = sorted(arrivals, key=lambda a: a[0])
        clock, i = 0.0, 0
        cost = step_time if callable(step_time) else (lambda out: float(step_time))
        for _ in range(max_steps):
            while i < len(pending) and pending[i][0] <= clock:
                self.scheduler.add_request(pending[i][1])
                i += 1
            if not self.scheduler.has_unfinished_requests():
                if i == len(pending):
                    return self.finished
                clock = pending[i][0]
                continue
            res = self.step()
            clock += cost(res.out)
        raise RuntimeError(f"not finished after max_steps={max_steps} steps: "
                           f"{self.scheduler.num_running} running, "
                           f"{self.scheduler.num_waiting} waiting")
