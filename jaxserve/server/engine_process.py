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
- The child (`python -m jaxserve.server.engine_process`, a fresh interpreter: no JAX
  state is ever forked, and the serving script is not re-imported) runs the unchanged `AsyncEngine` loop: the engine's steps, its output
  processing (detokenizer, stop strings, `RequestOutput`s) and the per-step
  `RequestDelta` snapshots, which it sends as one message a step together with the
  engine's stats.

What crosses the socket (`multiprocessing.connection.Connection`, pickle): the engine factory and the
functions of `call(fn)` as cloudpickle bytes (they are closures); `EngineRequest`s and
abort ids one way; `RequestDelta`s (this step's new tokens and text only), stats dicts,
warm-up progress and call results the other. `engine` in the API process is an
`EngineView`: the config, model name and tokenizer the routes read, and the LoRA adapter
names as of the last call.

If the engine process dies, every open stream ends with a 500 error event, pending
calls raise, and /health reports the engine failed; the process is never restarted.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import itertools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable

import cloudpickle

from jaxserve.server.async_engine import AsyncEngine, CompletionDelta, RequestDelta

logger = logging.getLogger(__name__)

# Seconds between two warm-up progress messages of the engine process.
_READINESS_POLL_S = 0.25


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


def _view_of(engine: Any) -> dict:
    lora = getattr(engine, "lora", None)
    return dict(config=engine.config, model_name=getattr(engine, "model_name", "jaxserve"),
                tokenizer=getattr(engine, "tokenizer", None),
                eos_token_ids=getattr(engine, "eos_token_ids", None),
                lora=None if lora is None else _LoRANames(_lora_names(engine)))


def _lora_names(engine: Any) -> list[str] | None:
    lora = getattr(engine, "lora", None)
    return None if lora is None else [r.lora_name for r in lora.list_loras()]


def _plain(d: RequestDelta) -> tuple:
    """A delta as nested plain tuples: pickled ~10x faster than the NamedTuples (whose
    pickle names their class once per object); `_delta` makes them again."""
    return (d[0], tuple(map(tuple, d[1])), *d[2:])


def _delta(p: tuple) -> RequestDelta:
    return RequestDelta(p[0], tuple(map(CompletionDelta._make, p[1])), *p[2:])


# ----------------------------------------------------------------------- the child
class _ChildLoop(AsyncEngine):
    """`AsyncEngine`'s loop in the engine process: outputs, finished requests and stats
    go to the pipe, one message per step, instead of to an event loop."""

    def __init__(self, conn: Any, factory: Callable[[], Any], max_queued_requests: int | None):
        self._conn = conn
        self._send_lock = threading.Lock()
        self._out: list[RequestDelta] = []
        self._fin: list[RequestDelta] = []
        self._in_step = False
        super().__init__(factory, on_finished=self._fin.append,
                         max_queued_requests=max_queued_requests)

    def send(self, msg: tuple) -> None:
        with self._send_lock:
            self._conn.send(msg)

    def _send(self, deltas: list[RequestDelta]) -> None:
        self._out += deltas

    def _step(self) -> None:
        self._in_step = True
        try:
            super()._step()
        finally:
            self._in_step = False
        self.flush(stepped=True)

    def _refresh_stats(self) -> None:
        super()._refresh_stats()
        if not self._in_step:
            self.flush(stepped=False)

    def flush(self, stepped: bool) -> None:
        out, self._out = self._out, []
        fin, self._fin[:] = list(self._fin), []
        self.send(("out", [_plain(d) for d in out], [_plain(d) for d in fin], self.stats,
                   stepped))

    def reply(self, call_id: int, fut: concurrent.futures.Future) -> None:
        """Send a command's result (or its exception) back; runs where `fut` completes."""
        exc = fut.exception()
        value = None if exc is not None else fut.result()
        names = _lora_names(self.engine) if self.engine is not None else None
        try:
            payload = pickle.dumps((exc, value))
        except Exception as e:  # noqa: BLE001 - an unpicklable result is the caller's error
            payload = pickle.dumps((RuntimeError(f"engine call result could not be sent: "
                                                 f"{type(e).__name__}: {e}"), None))
        self.send(("result", call_id, payload, names))

    def readiness_loop(self) -> None:
        """Send warm-up progress while it changes (progressive warm-up compiles on after
        the engine serves)."""
        last = None
        while not self._stop.wait(_READINESS_POLL_S):
            try:
                now = self.readiness()
            except Exception:  # noqa: BLE001 - progress is informational
                logger.exception("readiness failed")
                return
            if now != last:
                self.send(("readiness", now))
                last = now
            if now.get("warmup_done"):
                return

    def handle(self, msg: tuple) -> bool:
        """One command from the API process; False once it says stop."""
        kind = msg[0]
        if kind in ("add", "call"):
            fut: concurrent.futures.Future = concurrent.futures.Future()
            fut.add_done_callback(lambda f, cid=msg[2]: self.reply(cid, f))
            try:
                arg = cloudpickle.loads(msg[1]) if kind == "call" else msg[1]
            except Exception as e:  # noqa: BLE001 - e.g. a module this process lacks
                fut.set_exception(RuntimeError(f"engine call could not be received: "
                                               f"{type(e).__name__}: {e}"))
                return True
            self._commands.put((kind, arg, fut))
        elif kind in ("abort", "abort_all"):
            self._commands.put(msg)
        elif kind == "stop":
            return False
        return True


def _child_main(fd: int) -> None:
    """The engine process (`python -m jaxserve.server.engine_process FD`): read the init
    message (the factory, the API process's sys.path and log level) from the socket
    `fd`, build the engine on the loop thread, serve commands until "stop" or until the
    API process is gone, then exit. Ctrl-C reaches the whole process group: the API
    process's shutdown stops this one, so SIGINT is ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    _, factory_blob, max_queued_requests, log_level, path = conn.recv()
    sys.path[:] = path  # what the factory's modules were imported from (tests, scripts)
    try:  # tqdm's default lock is a multiprocessing semaphore, which `os._exit` would leak
        import tqdm

        tqdm.tqdm.set_lock(threading.RLock())
    except ImportError:
        pass
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s "
                        "[engine process]: %(message)s")
    child = _ChildLoop(conn, cloudpickle.loads(factory_blob), max_queued_requests)
    child.start(None)  # type: ignore[arg-type] - no event loop here: `_send` buffers
    progress = threading.Thread(target=child.readiness_loop, name="jaxserve-readiness",
                                daemon=True)
    progress.start()

    def announce() -> None:  # from a thread: the pipe keeps being read meanwhile
        child.wait_ready()
        if child.state == "ready":
            child.send(("ready", _view_of(child.engine)))
        else:
            child.send(("failed", child.error))

    threading.Thread(target=announce, name="jaxserve-announce", daemon=True).start()
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the API process is gone: nobody to serve
                logger.warning("API process gone; stopping the engine")
                break
            if not child.handle(msg):
                break
        child.stop()
        child.flush(stepped=False)  # what the shutdown's abort_all ended
        child.send(("stopped",))
    except (BrokenPipeError, EOFError, OSError):
        pass
    finally:
        # Daemon threads may be inside a compile; nothing here needs an orderly
        # interpreter shutdown.
        os._exit(0)


def factory_by_name(target: str, *args: Any) -> Any:
    """Call the function `target` ("module:function", an entry point's form) with `args`
    in the engine process: a factory by name for a function whose module is the API
    process's `__main__` (`python -m jaxserve.cli serve`), which a pickle cannot name.
    `functools.partial(factory_by_name, "jaxserve.cli:engine_in_process", argv)` is
    `jaxserve serve --engine_process`'s."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)(*args)


# ----------------------------------------------------------------------- the API side
class _PipeCommands:
    """`AsyncEngine._commands` for the API process: each `put` goes to the pipe; the
    futures of "add" and "call" wait for the engine process's "result"."""

    def __init__(self, owner: "ProcessAsyncEngine"):
        self._owner = owner
        self._ids = itertools.count()
        self.lock = threading.Lock()

    def put(self, cmd: tuple) -> None:
        kind, owner = cmd[0], self._owner
        if kind in ("add", "call"):
            cid = next(self._ids)
            fut = cmd[2]
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
            with self.lock:
                owner.conn.send(msg)
        except (BrokenPipeError, OSError):
            owner.fail_call(msg)


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
        ours, theirs = socket.socketpair()
        root = str(Path(__file__).resolve().parents[2])  # where `jaxserve` imports from
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "jaxserve.server.engine_process", str(theirs.fileno())],
            pass_fds=[theirs.fileno()], env=env)
        theirs.close()
        self.conn = Connection(ours.detach())
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

    def readiness(self) -> dict:
        """The engine process's warm-up progress as last reported ({} before it)."""
        return dict(self._readiness)

    # ------------------------------------------------------------------ the reader
    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                break
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
            elif kind == "stopped":
                self._stopped.set()
                return
        self._on_death()

    def _on_out(self, deltas: list[RequestDelta], fins: list[RequestDelta], stepped: bool,
                stats: dict) -> None:
        """On the event loop: deliver, then the metrics callbacks (as AsyncEngine's loop
        thread runs them)."""
        self._deliver(deltas)
        for d in fins:
            if self._on_finished is not None:
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

    def _on_death(self) -> None:
        """The engine process exited without being asked: fail what waits on it."""
        self.dead = True
        self._stopped.set()
        code = None
        if self._proc is not None:
            try:
                code = self._proc.wait(1.0)
            except subprocess.TimeoutExpired:
                pass
        self.error = f"the engine process exited unexpectedly (exit code {code})"
        logger.error("%s", self.error)
        if self.state in ("starting", "ready"):
            self.state = "failed"
        self._ready.set()
        for cid in list(self.calls):
            fut = self.calls.pop(cid)
            if not fut.done():
                fut.set_exception(RuntimeError(self.error))
        self._call_loop(self._fail_groups, self.error)

    def _fail_groups(self, message: str) -> None:
        """On the event loop: end every open stream with a 500 error item."""
        deltas = [RequestDelta(request_id=rid, outputs=(), finished=True, error=message,
                               status=500) for rid in list(self._groups)]
        self._deliver(deltas)
        for d in deltas:
            if self._on_finished is not None:
                self._safe(self._on_finished, d)

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


if __name__ == "__main__":  # the module's own copy: what it pickles names its real module
    from jaxserve.server import engine_process

    engine_process._child_main(int(sys.argv[1]))
