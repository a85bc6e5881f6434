"""`python -m jaxserve.engine.core_proc FD`: the engine-core process of `MPEngine`.

vLLM V1's EngineCore process: an `LLMEngine` (scheduler, runner, stop rules) whose output
processor is a `CoreOutputs` (`jaxserve.engine.core_outputs`), so that a step's
detokenizing, stop-string checks and `RequestOutput` assembly run in the frontend
(`jaxserve.engine.core_client.MPEngine`) while this process runs the next step.

Protocol (pickled tuples over one socket; the frontend's side is `MPEngine`):
  frontend -> core: ("init", factory (cloudpickle), log level, sys.path), ("credit",)
    (one more step may run), ("add", ProcessedRequest, lora_request), ("abort",
    [request ids]), ("stop", [child ids]) (stop strings found in their text), ("finish",
    [(child id, status)]) (the frontend's output processing failed them), ("call", id,
    fn (cloudpickle)) (fn(engine) between steps), ("shutdown",).
  core -> frontend: ("ready", view) or ("failed", why) once, then ("step", events) per
    credit (`CoreOutputs` events, with ("applied", n) markers: n commands applied when
    the events after it were recorded; "rejected" for an add that raised, "raised" for
    a step that raised) and ("reply", id, ok, value) per call.
A step runs only against a credit: the frontend keeps `MPEngine.steps_ahead` of them
out (2 by default), sending the next one before it processes the step it got, so the
core computes the steps after it meanwhile and is at most that many steps ahead.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import cloudpickle

logger = logging.getLogger("jaxserve.engine.core_proc")


def spawn(module: str) -> tuple[subprocess.Popen, Connection]:
    """Start `python -m module FD` (a fresh interpreter: no fork of jax's threads) with one
    end of a socket pair as FD; returns the process and our end. In a source checkout the
    child imports `jaxserve` from it (PYTHONPATH). Used by `MPEngine` and by the server's
    `--engine_process` (`jaxserve.server.engine_process`)."""
    ours, theirs = socket.socketpair()
    env = dict(os.environ)
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").exists():  # a source checkout: `jaxserve` imports from it
        env["PYTHONPATH"] = os.pathsep.join(
            [str(root)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.Popen([sys.executable, "-m", module, str(theirs.fileno())],
                            pass_fds=[theirs.fileno()], env=env)
    theirs.close()
    return proc, Connection(ours.detach())


def to_core(engine: Any) -> Any:
    """Give `engine` a `CoreOutputs` in place of its output processor (the engine's weight
    version moves along with it). Returns the `CoreOutputs`."""
    from jaxserve.engine.core_outputs import CoreOutputs

    sink = CoreOutputs()
    sink.weight_version = engine.weight_version
    sink.generation_tokens_total = engine.outputs.generation_tokens_total
    engine.outputs = engine.pauser.outputs = sink
    return sink


def view_of(engine: Any) -> dict:
    """What the frontend needs of the engine: config, tokenizer, EOS ids, model name."""
    return dict(config=engine.config, tokenizer=engine.tokenizer,
                eos_token_ids=engine.eos_token_ids,
                model_name=getattr(engine, "model_name", "jaxserve"))


class CoreLoop:
    """The engine core's loop: apply the frontend's commands in order, run one
    `engine.step()` per credit, send its events."""

    def __init__(self, conn: Connection, engine: Any):
        self.conn, self.engine = conn, engine
        self.sink = to_core(engine)
        self.credits = 0
        self.applied = 0  # commands applied (the frontend numbers them alike)

    def send(self, msg: tuple) -> None:
        self.conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def run(self) -> None:
        """Until "shutdown" or the frontend's socket closes."""
        conn = self.conn
        while True:
            while self.credits == 0 or conn.poll():
                self.applied += 1
                events = self.sink.events
                mark = len(events)
                if not self.handle(pickle.loads(conn.recv_bytes())):
                    return
                if len(events) > mark:  # e.g. a call's aborts: recorded while applying it
                    events.insert(mark, ("applied", self.applied))
            self.credits -= 1
            self.sink.events.append(("applied", self.applied))
            try:
                self.engine.step()  # its outputs are the sink's events
            except Exception as e:  # noqa: BLE001 - the caller's step() raises it; we go on
                logger.exception("engine step failed in the core")
                self.sink.events.append(("raised", f"{type(e).__name__}: {e}"))
            self.send(("step", self.sink.take()))

    def handle(self, msg: tuple) -> bool:
        """Apply one command; False on "shutdown"."""
        kind, eng, sink = msg[0], self.engine, self.sink
        if kind == "credit":
            self.credits += 1
        elif kind == "add":
            p = msg[1]
            try:
                eng.add_processed(p, msg[2])
            except Exception as e:  # noqa: BLE001 - the request's own fault: it alone fails
                sink.events.append(("rejected", p.request_id, f"{type(e).__name__}: {e}"))
        elif kind == "abort":
            for rid in msg[1]:
                eng.abort(rid)
        elif kind == "stop":  # a stop string matched: finish it "stop" (`_apply`'s)
            for cid in msg[1]:
                req = sink.request(cid)
                if req is not None:
                    eng.scheduler.stop_by_string(req)
            sink.ended(msg[1])
        elif kind == "finish":
            for cid, status in msg[1]:
                eng.scheduler.finish_requests([cid], status)
            sink.ended(cid for cid, _ in msg[1])
        elif kind == "call":
            try:
                value = cloudpickle.loads(msg[2])(eng)
                reply = ("reply", msg[1], True, value)
                pickle.dumps(reply)
            except Exception as e:  # noqa: BLE001 - handed back to the caller
                reply = ("reply", msg[1], False, e)
                try:
                    pickle.dumps(reply)
                except Exception:  # noqa: BLE001 - an exception that does not pickle
                    reply = ("reply", msg[1], False,
                             RuntimeError(f"{type(e).__name__}: {e} (in the engine core)"))
            self.send(reply)
        elif kind == "shutdown":
            return False
        return True


def _main(fd: int) -> None:
    conn = Connection(fd)
    try:
        kind, blob, level, path = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        os._exit(0)
    logging.basicConfig(level=level, format="%(asctime)s %(name)s: %(message)s")
    sys.path[:] = path
    try:
        engine = cloudpickle.loads(blob)()
        loop = CoreLoop(conn, engine)
        loop.send(("ready", view_of(engine)))
    except Exception as e:  # noqa: BLE001 - the frontend raises it
        logger.exception("the engine core could not be built")
        conn.send_bytes(pickle.dumps(("failed", f"{type(e).__name__}: {e}")))
        os._exit(1)
    try:
        loop.run()
    except (EOFError, OSError):  # the frontend is gone: nobody to serve
        pass
    except Exception as e:  # noqa: BLE001 - tell the frontend, then stop
        logger.exception("engine core failed")
        try:
            conn.send_bytes(pickle.dumps(("failed", f"{type(e).__name__}: {e}")))
        except OSError:
            pass
    os._exit(0)


if __name__ == "__main__":
    _main(int(sys.argv[1]))
