"""`python -m jaxserve.server.engine_main FD`: the engine process of `jaxserve serve
--engine_process` (the API side is `jaxserve.server.engine_process`). It runs
`AsyncEngine`'s unchanged loop (`_ChildLoop`): the engine's steps, its output processing
and the per-step deltas, sent to the API process one message a step. A module of its own,
so that the one run as `__main__` is not one the package has already imported."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import pickle
import signal
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any, Callable

import cloudpickle

from jaxserve.server.async_engine import AsyncEngine, RequestDelta
from jaxserve.server.engine_process import _LoRANames, _plain

logger = logging.getLogger("jaxserve.server.engine_main")

# Seconds between two warm-up progress messages.
_READINESS_POLL_S = 0.25


def _view_of(engine: Any) -> dict:
    """`EngineView`'s fields, read off the engine."""
    names = _lora_names(engine)
    return dict(config=engine.config, model_name=getattr(engine, "model_name", "jaxserve"),
                tokenizer=getattr(engine, "tokenizer", None),
                eos_token_ids=getattr(engine, "eos_token_ids", None),
                lora=None if names is None else _LoRANames(names))


def _lora_names(engine: Any) -> list[str] | None:
    lora = getattr(engine, "lora", None)
    return None if lora is None else [r.lora_name for r in lora.list_loras()]


class _ChildLoop(AsyncEngine):
    """`AsyncEngine`'s loop in the engine process: outputs, finished requests and stats
    go to the pipe, one message per step, instead of to an event loop."""

    def __init__(self, conn: Any, factory: Callable[[], Any], max_queued_requests: int | None):
        self._conn = conn
        self._send_lock = threading.Lock()
        self._out: list[RequestDelta] = []
        self._fin: list[RequestDelta] = []
        self._in_step = False
        self._futures: dict[int, concurrent.futures.Future] = {}  # call id -> not yet replied
        super().__init__(factory, on_finished=self._fin.append,
                         max_queued_requests=max_queued_requests)

    def send(self, msg: tuple) -> None:
        with self._send_lock:
            self._conn.send(msg)

    def send_or_fail(self, msg: tuple, *, instead: str = "fatal", why: str | None = None
                     ) -> None:
        """`send`, but a message that cannot be pickled is replaced by an `instead` one
        ("fatal": the API process then ends every stream and stops this process;
        "failed": the engine never became ready) saying `why`: nothing waits on a message
        that never comes."""
        try:
            blob = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - the engine's data, not the socket
            logger.exception("message %r could not be pickled", msg[0])
            why = why or f"engine process message {msg[0]!r} could not be sent"
            blob = pickle.dumps((instead, f"{why}: {type(e).__name__}: {e}"))
        with self._send_lock:
            self._conn.send_bytes(blob)

    def _send(self, deltas: list[RequestDelta]) -> None:
        self._out += deltas

    def _step(self) -> None:
        self._in_step = True
        failures = self.num_step_failures
        try:
            super()._step()
        finally:
            self._in_step = False
        # A step that raised runs no on_step in AsyncEngine's loop either.
        self.flush(stepped=self.num_step_failures == failures)

    def _refresh_stats(self) -> None:
        super()._refresh_stats()
        if not self._in_step:
            self.flush(stepped=False)

    def flush(self, stepped: bool) -> None:
        out, self._out = self._out, []
        fin, self._fin[:] = list(self._fin), []
        self.send_or_fail(("out", [_plain(d) for d in out], [_plain(d) for d in fin],
                           self.stats, stepped))

    def reply(self, call_id: int, fut: concurrent.futures.Future) -> None:
        """Send a command's result (or its exception) back; runs where `fut` completes."""
        self._futures.pop(call_id, None)
        if fut.cancelled():  # the API process cancelled it: nobody waits for a reply
            return
        exc = fut.exception()
        value = None if exc is not None else fut.result()
        names = _lora_names(self.engine) if self.engine is not None else None
        try:  # cloudpickle: an exception class defined in the caller's __main__ too
            payload = cloudpickle.dumps((exc, value))
        except Exception as e:  # noqa: BLE001 - an unpicklable result is the caller's error
            payload = cloudpickle.dumps((RuntimeError(
                f"engine call result could not be sent: {type(e).__name__}: {e}"), None))
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
                self.send_or_fail(("readiness", now))
                last = now
            if now.get("warmup_done"):
                return

    def handle(self, msg: tuple) -> bool:
        """One command from the API process; False once it says stop."""
        kind = msg[0]
        if kind in ("add", "call"):
            fut: concurrent.futures.Future = concurrent.futures.Future()
            self._futures[msg[2]] = fut
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
        elif kind == "cancel":  # its caller gave up: skipped unless the loop has begun it
            fut = self._futures.pop(msg[1], None)
            if fut is not None:
                fut.cancel()
        elif kind == "stop":
            return False
        return True


def _child_main(fd: int) -> None:
    """The engine process (`python -m jaxserve.server.engine_main FD`): read the init
    message (the factory, the API process's sys.path and log level) from the socket
    `fd`, build the engine on the loop thread, serve commands until "stop" or until the
    API process is gone, then exit. Ctrl-C reaches the whole process group: the API
    process's shutdown stops this one, so SIGINT is ignored, and SIGTERM too (systemd's
    control-group stop, `kill -TERM -PGID`): the API process's graceful shutdown then
    stops this one in order."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
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
    try:
        factory = cloudpickle.loads(factory_blob)
    except Exception as e:  # noqa: BLE001 - e.g. a module only the API process can import
        logger.exception("engine factory could not be read")
        conn.send(("failed", f"the engine factory could not be read in the engine process: "
                             f"{type(e).__name__}: {e}"))
        os._exit(1)
    child = _ChildLoop(conn, factory, max_queued_requests)
    child.start(None)  # type: ignore[arg-type] - no event loop here: `_send` buffers
    progress = threading.Thread(target=child.readiness_loop, name="jaxserve-readiness",
                                daemon=True)
    progress.start()

    def announce() -> None:  # from a thread: the pipe keeps being read meanwhile
        child.wait_ready()
        if child.state == "ready":  # e.g. a tokenizer that does not pickle: "failed"
            child.send_or_fail(("ready", _view_of(child.engine)), instead="failed",
                               why="the engine's config / tokenizer could not be sent to "
                                   "the API process")
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


if __name__ == "__main__":
    _child_main(int(sys.argv[1]))
