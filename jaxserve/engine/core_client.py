"""`MPEngine`: an `LLMEngine` run in its own process, its outputs assembled in this one.

vLLM V1's split (the EngineCore process and the frontend's OutputProcessor), for issue
24: the engine core (`jaxserve.engine.core_proc`) schedules, lays out, runs and applies
the stop rules; this process tokenizes prompts (`InputProcessor`), and per step
detokenizes, checks stop strings and builds the `RequestOutput`s (`OutputProcessor`)
while the core already runs the next step. Each side's Python runs on its own core, so a
step's period is the larger of the two halves instead of their sum.

    engine = MPEngine(functools.partial(build_my_engine, ...))  # built in the core
    engine.add_request("r0", "Hello", SamplingParams(max_tokens=16))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...
    engine.shutdown()

Each request's final output equals the one-process engine's
(tests/engine/test_core_client.py). What differs: a request joins a step or two later
(the core runs up to `steps_ahead` steps ahead), so which `step()` carries which tokens
follows the core's pace; a request whose stop string is found here has its KV freed a
step or two later (the tokens the core made after it are dropped here); an add the core
refuses (its LoRA adapter, its grammar, a sleeping engine with `reject_new`) ends with
finish_reason "error" and the reason instead of raising; a step that raises in the core
raises here and the core serves on; every other engine call goes through `call`. Known
gap: when a dispatch fails in the same core step as row errors, an n > 1 request may get
its outputs in one `RequestOutput` here where the one-process engine gives two (the
"collect" marker flushes every parent pending here).
"""

from __future__ import annotations

import logging
import pickle
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Any, Callable, Sequence

import cloudpickle

from jaxserve.engine.core_proc import spawn
from jaxserve.engine.input_processor import InputProcessor
from jaxserve.engine.output_processor import FinishRequests, OutputProcessor
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler.request import RequestStatus
from jaxserve.worker.runner import NO_TOP_IDS, NO_TOP_LOGPROBS, SampledToken

logger = logging.getLogger(__name__)

_RUNNING, _LENGTH, _STOPPED = (RequestStatus.RUNNING, RequestStatus.FINISHED_LENGTH,
                               RequestStatus.FINISHED_STOPPED)
_NO_TOPS = (NO_TOP_IDS, NO_TOP_LOGPROBS)  # a token whose request asked for no logprobs
_SMALL = 1 << 16  # bytes: commands larger than this are sent while the core's are read
# A frontend sample's `Request.grammar`: its matcher lives in the core (the output
# processor only asks whether there is one).
REMOTE_GRAMMAR = "in the engine core"


class EngineCoreError(RuntimeError):
    """The engine-core process failed or could not be started."""


class MPEngine:
    """`LLMEngine`'s `add_request` / `step` / `abort` with the engine in another process.

    Args:
      factory: a zero-argument callable that builds the `LLMEngine` (run in the core
        process; it crosses by cloudpickle, so a closure or `functools.partial` works).
      startup_timeout: seconds to wait for the core to be built (None: no limit).
      steps_ahead: steps the core may run whose outputs this side has not received (its
        credits). 2 (the default): the core starts step n+2 as soon as it sent step n+1,
        not waiting for this side to take a message while this side is at most a step
        behind, so a late wake-up here costs the device nothing (issue 24's bench at 256
        rows, D = 2 ms: ~480 against ~477 tokens per request per second, the core's wait
        for a credit 0.2 -> 0.03 ms a step); the price is that a stop string found here,
        an abort or an add reaches the core up to a step later than with 1.

    Raises:
      EngineCoreError: the core process failed to build its engine (the reason given).
      ValueError: steps_ahead < 1.
    """

    def __init__(self, factory: Callable[[], Any], *, startup_timeout: float | None = None,
                 steps_ahead: int = 2):
        if steps_ahead < 1:
            raise ValueError(f"steps_ahead={steps_ahead} must be >= 1")
        self.steps_ahead = steps_ahead
        self._proc, self.conn = spawn("jaxserve.engine.core_proc")
        self._sent = -1  # commands sent after "init"
        self._sent_adds = 0  # the number of the latest add
        # request / child id -> the number of the command that added it, while a step the
        # core ran before that command may still arrive (its events are the id's last use)
        self._born: dict[str, int] = {}
        self._send(("init", cloudpickle.dumps(factory), logging.getLogger().getEffectiveLevel(),
                    list(sys.path)))
        try:
            if startup_timeout is not None and not self.conn.poll(startup_timeout):
                raise EngineCoreError(f"the engine core was not ready in {startup_timeout} s")
            msg = self._recv()
        except BaseException:
            self.shutdown(timeout=0.0)
            raise
        view = msg[1]
        self.config, self.tokenizer = view["config"], view["tokenizer"]
        self.eos_token_ids, self.model_name = view["eos_token_ids"], view["model_name"]
        self.inputs = InputProcessor(self.config, self.tokenizer, self.eos_token_ids)
        self.outputs = FrontendOutputs(self.tokenizer,
                                       stream_interval=self.config.stream_interval)
        self._steps: deque[tuple] = deque()  # step messages read while awaiting a reply
        self._replies: dict[int, tuple] = {}
        self._calls = 0
        self._credits = 0  # steps the core may run that we have not received yet
        self.last_wait_s = 0.0  # the last `step()`'s seconds blocked on the core's message

    # ------------------------------------------------------------ transport
    def _send(self, msg: tuple) -> None:
        self._send_blob(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def _send_blob(self, blob: bytes) -> None:
        """Send one command. A large one is sent while a thread reads what the core sends
        meanwhile: the core may itself be blocked sending a large step (prompt logprobs)
        and reads commands only between steps; both sides blocked would deadlock."""
        try:
            if len(blob) <= _SMALL:
                self.conn.send_bytes(blob)
            else:
                self._send_draining(blob)
        except OSError as e:
            raise EngineCoreError(f"the engine core process is gone ({e})") from None
        self._sent += 1  # the core counts the commands it applied alike

    def _send_draining(self, blob: bytes) -> None:
        done = threading.Event()
        failed: list[BaseException] = []

        def drain() -> None:
            try:
                while not done.is_set():
                    if self.conn.poll(0.005):
                        self._keep(self._recv())
            except BaseException as e:  # noqa: BLE001 - raised by the caller's next read
                failed.append(e)
        reader = threading.Thread(target=drain, name="jaxserve-core-drain", daemon=True)
        reader.start()
        try:
            self.conn.send_bytes(blob)
        finally:
            done.set()
            reader.join()
        if failed:
            raise failed[0]

    def _keep(self, msg: tuple) -> None:
        if msg[0] == "step":
            self._steps.append(msg)
        else:
            self._replies[msg[1]] = msg

    def _recv(self) -> tuple:
        try:
            msg = pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError) as e:
            raise EngineCoreError(f"the engine core process is gone ({e})") from None
        if msg[0] == "failed":
            raise EngineCoreError(f"the engine core failed: {msg[1]}")
        return msg

    def _next(self, kind: str, call_id: int | None = None) -> tuple:
        """The next "step" message, or the reply to `call_id`; the other kind is kept."""
        while True:
            if kind == "step" and self._steps:
                return self._steps.popleft()
            if kind == "reply" and call_id in self._replies:
                return self._replies.pop(call_id)
            self._keep(self._recv())

    # ------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | Sequence[int] | None = None,
                    params: SamplingParams | None = None, *,
                    messages: Sequence[dict[str, Any]] | None = None, priority: int = 0,
                    arrival_time: float | None = None, logprob_start: int | None = None,
                    lora_request: Any = None) -> list[int]:
        """`LLMEngine.add_request`: validated and tokenized here, queued in the core.

        Raises:
          ValueError: as `LLMEngine.add_request`'s input checks (before anything is sent).
        """
        p = self.inputs.process(request_id, prompt, params, messages=messages, priority=priority,
                                arrival_time=arrival_time, live_ids=self.outputs.live_ids(),
                                logprob_start=logprob_start)
        blob = pickle.dumps(("add", p, lora_request), protocol=pickle.HIGHEST_PROTOCOL)
        grammar = p.children[0].sampling_params.structured_outputs is not None
        for req in p.children:  # this process's copies: live until the core says otherwise
            req.status = _RUNNING
            if grammar:
                req.grammar = REMOTE_GRAMMAR
        self._send_blob(blob)  # (raises before anything is registered here)
        self.outputs.add(p)
        self._sent_adds = self._sent
        born = self._born
        born[p.request_id] = self._sent
        for req in p.children:
            born[req.request_id] = self._sent
        return p.prompt_token_ids

    def abort(self, request_id: str) -> bool:
        """Abort a user request (frees its KV blocks in the core); False if unknown."""
        if self.outputs.pop(request_id) is None:
            return False
        self._send(("abort", [request_id]))
        return True

    def has_unfinished_requests(self) -> bool:
        return self.outputs.num_live > 0

    def step(self) -> list[RequestOutput]:
        """The outputs of the core's next step (waits for it); the core is let run up to
        `steps_ahead` steps past it first, so it computes them while these are
        assembled."""
        if not self.has_unfinished_requests():
            return []
        t0 = time.perf_counter()
        while True:
            while self._credits < self.steps_ahead:
                self._send(("credit",))
                self._credits += 1
            events = self._next("step")[1]
            self._credits -= 1
            self._send(("credit",))
            self._credits += 1
            if not _idle(events, self._sent_adds):
                break  # (else: a step run before our latest add, with nothing in it)
        self.last_wait_s = time.perf_counter() - t0
        return self._apply(events)

    def call(self, fn: Callable[[Any], Any]) -> Any:
        """fn(engine) in the core between two steps (e.g. `lambda e: e.update_params(w)`);
        its result (pickled back), or its exception raised here."""
        self._calls += 1
        cid = self._calls
        self._send(("call", cid, cloudpickle.dumps(fn)))
        _, _, ok, value = self._next("reply", cid)
        if not ok:
            raise value
        return value

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core process (killed after `timeout` seconds)."""
        try:
            self.conn.send_bytes(pickle.dumps(("shutdown",)))
        except OSError:
            pass
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self.conn.close()

    def __enter__(self) -> "MPEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------ one step's events
    def _apply(self, events: list[tuple]) -> list[RequestOutput]:
        """Replay the core's events through the output processor, in order; collect where
        the core's engine collected. ("applied", n) markers: what follows was recorded
        when the core had applied n commands, so an id added by a later command is not
        the one it speaks of (an id aborted or ended and reused meanwhile): dropped."""
        outs, changed, op = [], [], self.outputs
        stale: frozenset = frozenset()
        raised = None
        for ev in events:
            kind = ev[0]
            if kind == "applied":
                stale = self._stale_after(ev[1])
                continue
            if stale:
                ev = _without(ev, stale)
                kind = ev[0]
            if kind == "tokens":
                changed += self._tokens(*ev[1:])
            elif kind == "collect":
                outs += op.collect(changed)
                changed = []
            elif kind == "fail":
                changed += self._fail(ev[1], ev[2])
            elif kind == "scheduled":
                op.scheduled(ev[1], ev[2])
            elif kind == "scores":
                op.process_prompt_logprobs(ev[1])
            elif kind == "grammar":
                for cid, status, error in ev[1]:
                    req = op.request(cid)
                    if req is not None and not req.is_finished:
                        req.status = RequestStatus(status)
                        changed.append(op.end_by_grammar(cid, error))
            elif kind == "rejected":
                changed += self._rejected(ev[1], ev[2])
            elif kind == "aborted":  # by the core's own call (e.g. abort_older_than)
                op.pop(ev[1])
            elif kind == "raised":
                raised = ev[1]
        outs += op.collect(changed)
        if raised is not None:
            raise RuntimeError(f"engine step failed in the engine core: {raised}")
        return outs

    def _stale_after(self, applied: int) -> frozenset:
        """The ids added after command `applied`; forgets those added before it."""
        born = self._born
        if not born:
            return frozenset()
        stale = frozenset(i for i, n in born.items() if n > applied)
        if len(stale) < len(born):
            self._born = {i: born[i] for i in stale}
        return stale

    def _tokens(self, version: int, cids: list[str], ids: list[int], lps: list[float],
                tops: dict, finished: list) -> list:
        op = self.outputs
        op.weight_version = version
        request = op.request
        ended = {cid: (status, reason) for cid, status, reason in finished}
        progressed, fin = op.process_core_tokens(cids, ids, lps, tops, ended, time.monotonic())
        stop = []
        for req in fin.by_stop_string:  # `Scheduler.stop_by_string` on this side's copy
            if req.status is _RUNNING:
                req.status = _STOPPED
                stop.append(req.request_id)
            elif req.status == _LENGTH:
                req.status = _STOPPED
        failed = []
        for cid, status in fin.finished:
            req = request(cid)
            if req is not None and not req.is_finished:
                req.status = status
                failed.append((cid, status))
        if stop:
            self._send(("stop", stop))
        if failed:
            self._send(("finish", failed))
        return progressed

    def _fail(self, samples: Sequence[tuple[str, int]], message: str) -> list[str]:
        """Samples (child id, status) the engine failed with `message`, each given that
        status here, except one this side ended already (a stop string); their parents."""
        failed = []
        for cid, status in samples:
            req = self.outputs.request(cid)
            if req is not None and not req.is_finished:
                req.status = RequestStatus(status)
                failed.append(cid)
        return self.outputs.fail(failed, message)

    def _rejected(self, request_id: str, message: str) -> list[str]:
        """The core refused an add: its samples fail with `message`."""
        return self._fail([(req.request_id, RequestStatus.FINISHED_ERROR)
                           for req in self.outputs.requests_of(request_id)], message)


def _without(ev: tuple, stale: frozenset) -> tuple:
    """Event `ev` less what it says of the ids in `stale`."""
    kind = ev[0]
    if kind == "tokens":
        v, cids, ids, lps, tops, finished = ev[1:]
        keep = [i for i, c in enumerate(cids) if c not in stale]
        return ("tokens", v, [cids[i] for i in keep], [ids[i] for i in keep],
                [lps[i] for i in keep], tops, [f for f in finished if f[0] not in stale])
    if kind in ("fail", "grammar"):
        return (kind, tuple(x for x in ev[1] if x[0] not in stale)) + ev[2:]
    if kind == "scores":
        return ("scores", {c: v for c, v in ev[1].items() if c not in stale})
    if kind in ("scheduled", "rejected", "aborted") and ev[1] in stale:
        return ("none",)
    return ev


def _idle(events: list[tuple], latest_add: int) -> bool:
    """A step message with nothing in it, from a step the core ran before our latest add
    (an idle core runs the credit left out): `step()` waits for the next one."""
    if any(ev[0] not in ("applied", "collect") for ev in events):
        return False
    marks = [ev[1] for ev in events if ev[0] == "applied"]
    return bool(marks) and marks[-1] < latest_add


class FrontendOutputs(OutputProcessor):
    """The frontend's `OutputProcessor`: its samples' Requests are this process's copies,
    brought up to date from the core's events as they are replayed."""

    def process_core_tokens(self, cids: list[str], ids: list[int], lps: list[float],
                            tops: dict, ended: dict, now: float
                            ) -> tuple[list, FinishRequests]:
        """`process_tokens` of a "tokens" event (columns in row order; `ended[cid]` =
        (status, stop_reason) of the samples the core's stop rules finished), each token
        first appended to its sample's Request. A sample this side ended already (a stop
        string) gets none: they are the core's run-ahead."""
        progressed, fin = [], FinishRequests()
        child_of, all_parents = self._child_of, self._parents
        for cid, tid, lp in zip(cids, ids, lps):
            at = child_of.get(cid)
            if at is None:
                continue
            p = all_parents[at[0]]
            c = p.children[at[1]]
            req = c.request
            if req.status is not _RUNNING:
                continue
            req.output_token_ids.append(tid)
            if ended and cid in ended:
                status, req.stop_reason = ended[cid]
                req.status = RequestStatus(status)
            try:
                if p.direct:
                    d = c.detok
                    if (req.status is _RUNNING and req.grammar is None and d is not None
                            and d.plain):
                        progressed.append(self._direct_output(c, p, tid, lp, now))
                        continue
                tok = SampledToken(tid, lp, *tops.get(cid, _NO_TOPS))
                self._token(at, p, c, tok, now, fin, progressed)
            except Exception as e:  # this request alone fails
                self._token_failed(cid, at, c, e, fin, progressed)
        return progressed, fin
