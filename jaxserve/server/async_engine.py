"""Drive a (thread-unsafe) `LLMEngine` from asyncio: one loop thread, queues both ways.

All engine calls (construction, add_request, step, abort, get_stats) happen
on one background thread. The asyncio side talks to it through a command
queue (`queue.SimpleQueue`); the thread hands each step's outputs back with
one `loop.call_soon_threadsafe` per step, which fans them out to per-request
`OutputCollector`s (vLLM's RequestOutputCollector: a running request's deltas that its
stream has not read yet are merged into one). Nothing on the event loop ever waits for
device work.

The loop thread is defensive: an exception from `engine.step()` fails every
in-flight request with an error item (and aborts it in the engine) and the loop
keeps running; a request the engine itself fails arrives with
finish_reason "error". Same pattern as vLLM's AsyncLLM output handler and
JetStream's orchestrator threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Union

from jaxserve.errors import EngineSleepingError
from jaxserve.outputs import RequestMetrics, RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.output_collector import OutputCollector

if TYPE_CHECKING:  # the engine module loads jax; the server imports it only when it builds one
    from jaxserve.engine import LLMEngine

EngineOrFactory = Union["LLMEngine", Callable[[], "LLMEngine"]]

logger = logging.getLogger(__name__)

# How long the idle loop thread blocks on the command queue before it
# re-checks the stop flag (seconds).
_IDLE_POLL_S = 0.05


class CompletionDelta(NamedTuple):
    """What one sample produced in one engine step (a copy: the engine may reuse objects).

    `token_ids` and `logprobs` are this step's new entries only; `num_tokens`
    is the sample's cumulative generated-token count after the step. A NamedTuple, as
    `RequestDelta`: one is made per row per step, ~2x cheaper than a frozen dataclass
    (with the engine in its own process they cross as plain tuples:
    `jaxserve.server.engine_process._plain`).
    """

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[dict[int, float], ...] | None
    num_tokens: int
    finish_reason: str | None
    stop_reason: int | str | None
    error: str | None


class RequestDelta(NamedTuple):
    """One engine request's progress in one step, or its synthetic failure.

    `error` is set (and `finished` is True) when the server ended the request
    itself. `status` says why: 500 engine step failure, 503 shutdown, 499
    client went away (never delivered; only counted in metrics).
    """

    request_id: str
    outputs: tuple[CompletionDelta, ...]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None
    status: int = 500
    # The request's prompt logprobs (vLLM's list, None for the first token) once its
    # prefill is done, when asked for (SamplingParams.prompt_logprobs); else None.
    prompt_logprobs: list | None = None


@dataclass(frozen=True)
class EngineRequest:
    """Arguments of one `engine.add_request` call."""

    request_id: str
    prompt: str | list[int] | None
    params: SamplingParams
    messages: list[dict] | None = None
    priority: int = 0
    lora_name: str | None = None  # a registered LoRA adapter (the request's `model`)


class AddRequestError(ValueError):
    """`engine.add_request` rejected request number `index` of a group."""

    def __init__(self, index: int, cause: ValueError):
        super().__init__(str(cause))
        self.index = index

    def __reduce__(self) -> tuple:  # pickled by the engine process (`engine_process`)
        return AddRequestError, (self.index, ValueError(str(self)))


class QueueFullError(RuntimeError):
    """The waiting queue holds `max_queued_requests`; the server answers 503 + Retry-After."""


class RequestGroup:
    """The engine requests of one HTTP request, read as one async stream of `RequestDelta`.

    Iterate with `async for`; iteration ends once every request finished.
    `abort()` cancels whatever is unfinished (idempotent, callable any time).
    """

    def __init__(self, engine: "AsyncEngine", request_ids: list[str]):
        self._engine = engine
        self.request_ids = request_ids
        self.prompt_token_ids: list[list[int]] = []
        self.queue = OutputCollector()  # merges a running request's unread deltas
        self._unfinished = set(request_ids)

    @property
    def finished(self) -> bool:
        return not self._unfinished

    async def next(self) -> RequestDelta:
        delta = await self.queue.get()
        if delta.finished:
            self._unfinished.discard(delta.request_id)
        return delta

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestDelta:
        if self.finished:
            raise StopAsyncIteration
        return await self.next()

    def abort(self) -> None:
        if self._unfinished:
            self._engine._abort(list(self._unfinished))
            self._unfinished.clear()
        self._engine._unregister(self)


def _snapshot(out: RequestOutput) -> RequestDelta:
    comps = tuple(
        CompletionDelta(
            index=c.index, text=c.delta_text, token_ids=tuple(c.delta_token_ids),
            logprobs=None if c.delta_logprobs is None else tuple(dict(d) for d in c.delta_logprobs),
            num_tokens=c.num_tokens, finish_reason=c.finish_reason,
            stop_reason=c.stop_reason, error=c.error)
        for c in out.outputs)
    return RequestDelta(request_id=out.request_id, outputs=comps, finished=bool(out.finished),
                        metrics=out.metrics if out.finished else None,
                        prompt_logprobs=out.prompt_logprobs)


class AsyncEngine:
    """Own an engine on a background thread and serve asyncio callers.

    Args:
      engine_or_factory: an `LLMEngine`, or a zero-argument callable
        that builds one (run on the loop thread, so warm-up happens while the
        HTTP server already answers 503 "warming up").
      on_step: optional callback `(stats: dict) -> None` run on the loop thread
        after every step (metrics).
      on_finished: optional callback `(delta: RequestDelta) -> None` run on the
        loop thread for every finished request (latency histograms).
      max_queued_requests: most engine requests waiting to be scheduled (None:
        unbounded). An add that would exceed it fails with `QueueFullError`
        (checked on the loop thread, so a burst cannot overshoot).

    States: "starting" -> "ready" -> "stopping" -> "stopped", or "failed" when
    the factory raised.
    """

    def __init__(self, engine_or_factory: EngineOrFactory, *,
                 on_step: Callable[[dict], None] | None = None,
                 on_finished: Callable[[RequestDelta], None] | None = None,
                 max_queued_requests: int | None = None):
        if max_queued_requests is not None and max_queued_requests < 1:
            raise ValueError(f"max_queued_requests={max_queued_requests} must be >= 1 or None "
                             "(0 would refuse every request)")
        self.max_queued_requests = max_queued_requests
        self.engine: LLMEngine | None
        self._factory: Callable[[], LLMEngine] | None
        if callable(engine_or_factory) and not hasattr(engine_or_factory, "add_request"):
            self._factory, self.engine = engine_or_factory, None
        else:
            self._factory, self.engine = None, engine_or_factory
        self._on_step = on_step
        self._on_finished = on_finished
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._groups: dict[str, RequestGroup] = {}  # event-loop thread only
        self._in_flight: set[str] = set()  # loop thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.state = "starting"
        self.error: str | None = None
        self.stats: dict = {}
        self.num_step_failures = 0

    # ---------------------------------------------------------------- lifecycle
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the loop thread; outputs are delivered on `loop`."""
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine-loop", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block (not on the event loop!) until the engine is built; True if ready."""
        self._ready.wait(timeout)
        return self.state == "ready"

    def begin_shutdown(self) -> None:
        """Refuse new work (503) and abort every in-flight request, ending its stream."""
        if self.state in ("starting", "ready"):
            self.state = "stopping"
        self._commands.put(("abort_all", "server is shutting down", 503))

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything, stop the loop thread and join it."""
        self.begin_shutdown()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        close = getattr(getattr(self.engine, "runner", None), "close", None)
        if close is not None:  # a background (progressive) warm-up stops after its program
            close(timeout)
        self.state = "stopped"

    @property
    def is_ready(self) -> bool:
        return self.state == "ready"

    def readiness(self) -> dict:
        """Live warm-up progress, read from the runner (any thread): {"programs_ready",
        "programs_total", "warmup_done"}; {} before the engine exists."""
        runner = getattr(self.engine, "runner", None)
        if runner is None:
            return {}
        st = runner.stats()
        return {"programs_ready": st.programs_ready, "programs_total": st.warmup_programs,
                "warmup_done": st.warmup_done}

    # ---------------------------------------------------------------- asyncio API
    async def submit(self, requests: list[EngineRequest]) -> RequestGroup:
        """Add a group of engine requests atomically; return their output stream.

        Raises:
          AddRequestError: the engine rejected one of them (none stays queued).
          RuntimeError: the engine is not ready (warming up, failed or stopping).
        """
        if not self.is_ready:
            raise RuntimeError(f"engine is {self.state}")
        group = RequestGroup(self, [r.request_id for r in requests])
        for rid in group.request_ids:
            self._groups[rid] = group
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("add", requests, fut))
        try:
            group.prompt_token_ids = await asyncio.wrap_future(fut)
        except BaseException:
            # Rejected, or the client went away while the add was queued: the
            # abort command follows the add in FIFO order, so nothing leaks.
            group.abort()
            raise
        return group

    async def call(self, fn: Callable[["LLMEngine"], Any]) -> Any:
        """Run `fn(engine)` on the loop thread between steps (the engine is not
        thread-safe) and return its result; its exception is re-raised here.

        Raises:
          RuntimeError: the engine is not ready.
        """
        if not self.is_ready:
            raise RuntimeError(f"engine is {self.state}")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", fn, fut))
        return await asyncio.wrap_future(fut)

    def _abort(self, request_ids: list[str]) -> None:
        self._commands.put(("abort", request_ids))

    def _unregister(self, group: RequestGroup) -> None:
        for rid in group.request_ids:
            if self._groups.get(rid) is group:
                del self._groups[rid]

    def _deliver(self, deltas: list[RequestDelta]) -> None:
        """Runs on the event loop: fan a step's outputs out to their groups."""
        for d in deltas:
            group = self._groups.get(d.request_id)
            if group is None:  # aborted by its client meanwhile
                continue
            group.queue.put(d)
            if d.finished:
                del self._groups[d.request_id]

    def _send(self, deltas: list[RequestDelta]) -> None:
        if deltas and self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._deliver, deltas)
            except RuntimeError:  # loop closed during shutdown
                pass

    # ---------------------------------------------------------------- loop thread
    def _run(self) -> None:
        if self._factory is not None:
            try:
                self.engine = self._factory()
            except Exception as e:  # noqa: BLE001 - reported through /health
                logger.exception("engine construction failed")
                self.error = f"{type(e).__name__}: {e}"
                self.state = "failed"
                self._ready.set()
                return
        if self.state == "starting":
            self.state = "ready"
        self._refresh_stats()
        self._ready.set()
        while not self._stop.is_set():
            # Paused (issue 28): nothing is scheduled, so wait on the command queue rather
            # than spin; a step still runs after each wake-up, to hand back what the pause
            # ended (its outputs come from `step()`).
            busy = self.engine.has_unfinished_requests() and not self.engine.is_paused
            worked = self._drain_commands(block=not busy)
            if self.engine.has_unfinished_requests():
                self._step()  # refreshes stats itself
            elif worked:
                self._refresh_stats()
        self._abort_all("server is shutting down", 503)

    def _drain_commands(self, block: bool) -> bool:
        worked = False
        try:
            cmd = self._commands.get(timeout=_IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return False
        while True:
            worked = True
            try:
                self._execute(cmd)
            except Exception:  # noqa: BLE001 - a bad command must not kill the loop
                logger.exception("engine command %r failed", cmd[0])
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return worked

    def _execute(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            self._add_group(cmd[1], cmd[2])
        elif kind == "abort":
            for rid in cmd[1]:
                if rid in self._in_flight:
                    self._in_flight.discard(rid)
                    self.engine.abort(rid)
                    if self._on_finished is not None:
                        self._safe(self._on_finished, RequestDelta(
                            request_id=rid, outputs=(), finished=True,
                            error="aborted by client", status=499))
        elif kind == "abort_all":
            self._abort_all(cmd[1], cmd[2])
        elif kind == "call":
            fut = cmd[2]
            if fut.set_running_or_notify_cancel():
                try:
                    result = cmd[1](self.engine)
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    self._refresh_stats()
                    fut.set_exception(e)
                else:  # stats first: /health read right after the call sees its effect
                    self._refresh_stats()
                    fut.set_result(result)

    def _add_group(self, requests: list[EngineRequest], fut: concurrent.futures.Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        if self.state != "ready":
            fut.set_exception(RuntimeError(f"engine is {self.state}"))
            return
        if self.max_queued_requests is not None:
            waiting = self.engine.get_stats()["num_waiting"]  # scheduler (child) requests
            new = sum(r.params.n for r in requests)
            if waiting + new > self.max_queued_requests:
                fut.set_exception(QueueFullError(
                    f"server overloaded: {waiting} requests waiting + {new} new "
                    f"exceeds max_queued_requests={self.max_queued_requests}"))
                return
        added: list[str] = []
        prompt_ids: list[list[int]] = []
        for i, r in enumerate(requests):
            try:
                lora = {} if r.lora_name is None else {
                    "lora_request": self.engine.lora.request_named(r.lora_name)}
                ids = self.engine.add_request(r.request_id, r.prompt, r.params,
                                              messages=r.messages, priority=r.priority, **lora)
            except Exception as e:  # noqa: BLE001 - reported to the caller
                if not isinstance(e, (ValueError, EngineSleepingError)):  # an engine gap: log
                    logger.exception("add_request(%s) raised %s", r.request_id, type(e).__name__)
                for rid in added:
                    self.engine.abort(rid)
                    self._in_flight.discard(rid)
                if isinstance(e, EngineSleepingError):  # the group's 503, not a bad request
                    fut.set_exception(e)
                    return
                err = e if isinstance(e, ValueError) else ValueError(f"{type(e).__name__}: {e}")
                fut.set_exception(AddRequestError(i, err))
                return
            added.append(r.request_id)
            self._in_flight.add(r.request_id)
            prompt_ids.append(list(ids))
        fut.set_result(prompt_ids)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail the batch, keep serving
            self.num_step_failures += 1
            logger.exception("engine.step() failed; failing %d in-flight requests",
                             len(self._in_flight))
            self._abort_all(f"engine step failed: {type(e).__name__}: {e}", 500)
            self._refresh_stats()
            return
        deltas = []
        for out in outputs:
            if out.request_id not in self._in_flight:
                continue
            d = _snapshot(out)
            deltas.append(d)
            if d.finished:
                self._in_flight.discard(d.request_id)
                if self._on_finished is not None:
                    self._safe(self._on_finished, d)
        self._send(deltas)
        self._refresh_stats()
        if self._on_step is not None:
            self._safe(self._on_step, self.stats)

    def _abort_all(self, message: str, status: int) -> None:
        failed = []
        for rid in sorted(self._in_flight):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001
                logger.exception("abort(%s) failed", rid)
            d = RequestDelta(request_id=rid, outputs=(), finished=True, error=message,
                             status=status)
            failed.append(d)
            if self._on_finished is not None:
                self._safe(self._on_finished, d)
        self._in_flight.clear()
        self._send(failed)

    def _refresh_stats(self) -> None:
        try:
            stats = self.engine.get_stats()
            # Steps that failed: raised out of engine.step(), or failed inside it (the
            # engine failed their requests itself and carried on).
            self.stats = dict(stats, engine_step_failures=self.num_step_failures
                              + stats.get("num_failed_steps", 0))
        except Exception:  # noqa: BLE001
            logger.exception("engine.get_stats() failed")

    @staticmethod
    def _safe(fn: Callable, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - metrics must never kill the loop
            logger.exception("engine-loop callback failed")
