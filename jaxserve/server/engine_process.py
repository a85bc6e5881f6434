"""The engine in its own process (`jaxserve serve --engine_process`; issue 24).

vLLM V1 runs its engine core in one process and the API server in another (`AsyncLLM`
over `EngineCoreClient`), SGLang its scheduler apart from its tokenizer manager: the HTTP
loop's work per SSE event (JSON, the socket writes) then runs beside the engine's step
instead of taking turns with it on one GIL. Here the split sits at `AsyncEngine`'s
seam, so nothing else in the server changes:

- `ProcessAsyncEngine` (the API process) has `AsyncEngine`'s interface: `submit`,
  `call`, `RequestGroup` streams with their `OutputCollector`s, `stats`, `readiness`,
  `start` / `begin_shutdown` / `stop`. Its command queue is a pipe to the child, and a
  reader thread hands each message's deltas to the event loop.
- The child (`python -m jaxserve.server.engine_main`, a fresh interpreter: no JAX
  state is ever forked, and the serving script is not re-imported) runs the unchanged
  `AsyncEngine` loop: the engine's steps, its output processing (detokenizer, stop
  strings, `RequestOutput`s) and the per-step `RequestDelta` snapshots, which it sends
  as one message a step together with the engine's stats.

What crosses the socket (`multiprocessing.connection.Connection`, pickle): the engine
factory and the functions of `call(fn)` as cloudpickle bytes (they are closures; pickled
and sent by a sender thread, so a weight tree does not stall the event loop); `EngineRequest`s
and abort ids one way; `RequestDelta`s (this step's new tokens and text only, as plain
tuples), stats dicts, warm-up progress and call results the other. `engine` in the API
process is an `EngineView`: the config, model name and tokenizer the routes read, and
the LoRA adapter names as of the last call.

If the engine process dies, or sends what cannot be read or sent ("fatal"), it is
killed, every open stream ends with a 500 error event, pending calls raise, and /health
reports the engine failed; the process is never restarted. A `call` or add whose caller
gives up is cancelled in the engine process too (skipped unless its loop has begun it,
as in-thread). Warm-up progress is up to 0.25 s old.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import itertools
import logging
import pickle
import queue
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import cloudpickle

from jaxserve.server.async_engine import AsyncEngine, CompletionDelta, RequestDelta

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _LoRAName:
    lora_name: str


@dataclass
class _LoRANames:
    """`engine.lora` as the API process sees it: `list_loras()` only."""

    names: list[str] = field(default_factory=list)

    def list_loras(self) -> list[_LoRAName]:
        return [_LoRAName(n) for n in self.names]


@dataclass
class EngineView:
    """What the API process reads of the engine in the other process.

    Attributes:
      config: the engine's `EngineConfig` (limits, max_model_len, dtype).
      model_name: the engine's `model_name`.
      tokenizer: a copy of the engine's tokenizer (token strings, chat templates,
        /tokenize), or None.
      eos_token_ids: the engine's EOS ids (for the grammar compiler).
      lora: the adapters' names as of the engine's last reply (`list_loras()`).
    """

    config: Any
    model_name: str
    tokenizer: Any
    eos_token_ids: Any
    lora: _LoRANames | None = None
    _grammars: Any = None

    @property
    def grammars(self) -> Any:
        """A `GrammarCompiler` of this process (the routes compile a spec before the 200
        to turn a bad one into a 400; the engine compiles it again from its own cache),
        or None without a tokenizer."""
        if self._grammars is None and self.tokenizer is not None:
            from jaxserve.structured_output import GrammarCompiler

            self._grammars = GrammarCompiler(self.tokenizer, self.config.model.vocab_size,
                                             self.eos_token_ids)
        return self._grammars


def _plain(d: RequestDelta) -> tuple:
    """A delta as nested plain tuples: pickled ~10x faster than the NamedTuples (whose
    pickle names their class once per object); `_delta` makes them again."""
    return (d[0], tuple(map(tuple, d[1])), *d[2:])


def _delta(p: tuple) -> RequestDelta:
    return RequestDelta(p[0], tuple(map(CompletionDelta._make, p[1])), *p[2:])


def factory_by_name(target: str, *args: Any) -> Any:
    """Call the function `target` ("module:function", an entry point's form) with `args`
    in the engine process: a factory by name for a function whose module is the API
    process's `__main__` (`python -m jaxserve.cli serve`), which a pickle cannot name.
    `functools.partial(factory_by_name, "jaxserve.cli:engine_in_process", argv)` is
    `jaxserve serve --engine_process`'s."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)(*args)


# ----------------------------------------------------------------------- the API side
class _Fatal(Exception):
    """The engine process said it cannot go on (a message it could not pickle)."""


class _PipeCommands:
    """`AsyncEngine._commands` for the API process: `put` (any thread, never blocks)
    queues a command; one sender thread pickles and sends them in order, so a call that
    holds a whole weight tree never stalls the event loop, and an abort follows its add.
    The futures of "add" and "call" wait for the engine process's "result"."""

    def __init__(self, owner: "ProcessAsyncEngine"):
        self._owner = owner
        self._ids = itertools.count()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine-sender",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then end the sender thread."""
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def put(self, cmd: tuple) -> None:
        self._queue.put(cmd)

    def _run(self) -> None:
        while (cmd := self._queue.get()) is not None:
            try:
                self._send(cmd)
            except Exception:  # noqa: BLE001 - one bad command must not stop the others
                logger.exception("engine command %r could not be sent", cmd[0])

    def _send(self, cmd: tuple) -> None:
        kind, owner = cmd[0], self._owner
        fut = None
        if kind in ("add", "call"):
            cid = next(self._ids)
            fut = cmd[2]
            if fut.cancelled():  # its caller went away before it was sent
                return
            owner.calls[cid] = fut
            try:
                arg = cloudpickle.dumps(cmd[1]) if kind == "call" else cmd[1]
            except Exception as e:  # noqa: BLE001 - the caller's function, not the engine
                owner.calls.pop(cid, None)
                fut.set_exception(TypeError(f"engine call cannot be sent to the engine "
                                            f"process: {type(e).__name__}: {e}"))
                return
            msg: tuple = (kind, arg, cid)
        else:
            msg = cmd
        if owner.dead:
            owner.fail_call(msg)
            return
        try:
            owner.conn.send(msg)
        except (BrokenPipeError, OSError):
            owner.fail_call(msg)
            return
        if fut is not None:  # a caller that gives up: the engine skips it if it can
            fut.add_done_callback(lambda f, cid=msg[2]: f.cancelled() and self._cancel(cid))

    def _cancel(self, cid: int) -> None:
        self._owner.calls.pop(cid, None)
        self.put(("cancel", cid))


class ProcessAsyncEngine(AsyncEngine):
    """`AsyncEngine` with the engine in a child process (vLLM V1's engine-core process).

    Args:
      factory: a zero-argument callable that builds the engine, run in the child; it
        crosses the process boundary by value (cloudpickle), so a closure works, but
        what it captures is copied (build big things inside it).
      on_step, on_finished, max_queued_requests: as `AsyncEngine`'s; the callbacks run
        in this process (on_step with each step's stats, on_finished for each finished
        request, client aborts' 499 included).

    Raises:
      ValueError: `factory` is an engine object (one process cannot hand a built engine
        to another), or a bad `max_queued_requests`.
      TypeError: `factory` cannot be pickled.
    """

    def __init__(self, factory: Callable[[], Any], *,
                 on_step: Callable[[dict], None] | None = None,
                 on_finished: Callable[[RequestDelta], None] | None = None,
                 max_queued_requests: int | None = None):
        if not callable(factory) or hasattr(factory, "add_request"):
            raise ValueError("engine_process needs a zero-argument engine factory, not an "
                             f"engine ({type(factory).__name__}): the engine is built in "
                             "its own process")
        super().__init__(factory, on_step=on_step, on_finished=on_finished,
                         max_queued_requests=max_queued_requests)
        try:
            self._blob = cloudpickle.dumps(factory)
        except Exception as e:
            raise TypeError(f"engine_process: the engine factory cannot be pickled: "
                            f"{type(e).__name__}: {e}") from e
        self._factory = None
        self._commands = _PipeCommands(self)  # type: ignore[assignment]
        self.calls: dict[int, concurrent.futures.Future] = {}
        self.conn: Any = None
        self.dead = False
        self._proc: Any = None
        self._readiness: dict = {}
        self._stopped = threading.Event()

    # ------------------------------------------------------------------ lifecycle
    def start(self, loop: Any) -> None:
        """Start the engine process and the thread that reads its messages."""
        self._loop = loop
        from jaxserve.engine.core_proc import spawn

        self._proc, self.conn = spawn("jaxserve.server.engine_main")
        self._commands.start()
        self.conn.send(("init", self._blob, self.max_queued_requests,
                        logging.getLogger().getEffectiveLevel(), list(sys.path)))
        self._thread = threading.Thread(target=self._read, name="jaxserve-engine-reader",
                                        daemon=True)
        self._thread.start()

    @property
    def pid(self) -> int | None:
        """The engine process's pid (None before `start`)."""
        return None if self._proc is None else self._proc.pid

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything, stop the engine process and wait for it (killed after
        `timeout` seconds)."""
        if self.conn is None:  # never started
            self.state = "stopped"
            return
        self.begin_shutdown()
        self._commands.put(("stop",))
        self._stopped.wait(timeout)
        if self._proc is not None:
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.error("engine process did not stop in %.0f s; killing it", timeout)
                self._proc.kill()
                self._proc.wait(5)
        self.state = "stopped"
        if self._thread is not None:
            self._thread.join(5)
        self._commands.close()
        self.conn.close()
        grammars = getattr(self.engine, "_grammars", None)
        if grammars is not None:
            grammars.close()

    def readiness(self) -> dict:
        """The engine process's warm-up progress as last reported ({} before it)."""
        return dict(self._readiness)

    # ------------------------------------------------------------------ the reader
    def _read(self) -> None:
        """The reader thread. Whatever ends it but the "stopped" reply (the socket
        closing, a message this process cannot read, a "fatal" one) is the engine
        process's death: it is killed, and every call and stream waiting on it fails."""
        why = None
        while True:
            try:
                msg = self.conn.recv()
                if self._handle(msg):
                    return
            except (EOFError, OSError):
                break
            except _Fatal as e:
                why = str(e)
                break
            except Exception as e:  # noqa: BLE001 - e.g. an unpicklable message
                logger.exception("engine process message unreadable")
                why = f"a message from the engine process was unreadable: {type(e).__name__}: {e}"
                break
        self._on_death(why)

    def _handle(self, msg: tuple) -> bool:
        """One message from the engine process; True once it has stopped."""
        kind = msg[0]
        if kind == "out":
            _, deltas, fins, stats, stepped = msg
            deltas, fins = [_delta(p) for p in deltas], [_delta(p) for p in fins]
            self.stats = stats
            self._call_loop(self._on_out, deltas, fins, stepped, stats)
        elif kind == "result":
            _, cid, payload, names = msg
            self._on_result(cid, payload, names)
        elif kind == "readiness":
            self._readiness = msg[1]
        elif kind == "ready":
            self.engine = EngineView(**msg[1])
            if self.state == "starting":
                self.state = "ready"
            self._ready.set()
        elif kind == "failed":
            self.error, self.state = msg[1], "failed"
            self._ready.set()
        elif kind == "fatal":
            raise _Fatal(msg[1])
        elif kind == "stopped":
            self._stopped.set()
            return True
        return False

    def _on_out(self, deltas: list[RequestDelta], fins: list[RequestDelta], stepped: bool,
                stats: dict) -> None:
        """On the event loop: deliver, then the metrics callbacks (as AsyncEngine's loop
        thread runs them)."""
        self._deliver(deltas)
        if self._on_finished is not None:
            for d in fins:
                self._safe(self._on_finished, d)
        if stepped and self._on_step is not None:
            self._safe(self._on_step, stats)

    def _on_result(self, cid: int, payload: bytes, names: list[str] | None) -> None:
        fut = self.calls.pop(cid, None)
        if names is not None and self.engine is not None and self.engine.lora is not None:
            self.engine.lora.names = names
        try:
            exc, value = pickle.loads(payload)
        except Exception as e:  # noqa: BLE001 - a class this process cannot import
            exc, value = RuntimeError(f"engine call result unreadable: {e}"), None
        if fut is None or fut.cancelled():
            return
        try:
            fut.set_exception(exc) if exc is not None else fut.set_result(value)
        except concurrent.futures.InvalidStateError:  # cancelled meanwhile
            pass

    def _on_death(self, why: str | None = None) -> None:
        """The engine process is gone or unusable (`why`): kill it if it still runs, then
        fail what waits on it. During `stop()` only the waiting is failed, silently."""
        self.dead = True
        code = None
        if self._proc is not None:
            if why is not None and self._proc.poll() is None:
                self._proc.kill()
            try:
                code = self._proc.wait(1.0)
            except subprocess.TimeoutExpired:
                pass
        stopping = self.state in ("stopping", "stopped")
        if not (self.state == "failed" and self.error):  # a "failed" message said why
            self.error = why or f"the engine process exited unexpectedly (exit code {code})"
        if not stopping:
            logger.error("%s", self.error)
            self.state = "failed"
        self._stopped.set()
        self._ready.set()
        for cid in list(self.calls):
            fut = self.calls.pop(cid, None)  # `fail_call` may have taken it meanwhile
            if fut is not None and not fut.done():
                fut.set_exception(RuntimeError(self.error))
        self._call_loop(self._fail_groups, self.error)

    def _fail_groups(self, message: str) -> None:
        """On the event loop: end every open stream with a 500 error item."""
        deltas = [RequestDelta(request_id=rid, outputs=(), finished=True, error=message,
                               status=500) for rid in list(self._groups)]
        self._on_out(deltas, deltas, False, self.stats)

    def fail_call(self, msg: tuple) -> None:
        """A command sent after the engine process died: its future fails at once."""
        if msg[0] in ("add", "call"):
            fut = self.calls.pop(msg[2], None)
            if fut is not None and not fut.done():
                fut.set_exception(RuntimeError(self.error or "the engine process is gone"))

    def _call_loop(self, fn: Callable, *args: Any) -> None:
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # loop closed during shutdown
                pass
