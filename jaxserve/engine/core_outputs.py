"""The engine-core process's output side: what a step produced, as compact events.

vLLM V1 splits the engine in two processes: the EngineCore (scheduler, model runner,
stop rules) sends `EngineCoreOutputs` (new token ids, logprobs, finish reasons) each
step, and the frontend's OutputProcessor detokenizes, checks stop strings and builds
`RequestOutput`s. `CoreOutputs` takes the `OutputProcessor`'s place inside an
`LLMEngine` run by `jaxserve.engine.core_proc`: the engine calls it exactly where it
calls the output processor, and it records what happened in call order (`Event`s) for
`jaxserve.engine.core_client.MPEngine` to replay through a real `OutputProcessor`:

- ("scheduled", request_id, t): a request's first plan (`RequestMetrics.first_scheduled_time`).
- ("fail", ((child_id, status), ...), message): samples the engine failed (row errors,
  a step failed twice, a pause's abort), with the status the scheduler gave them.
- ("scores", {child_id: PromptLogprobs}): prompt logprobs of a step.
- ("tokens", weight_version, child_ids, token_ids, logprobs, tops, finished): a step's
  sampled tokens in row order, sampled under that weight version (`tops[child_id]` = (top_ids, top_logprobs) for samples that asked for
  logprobs), and (child_id, status, stop_reason) of the samples the scheduler's stop rules
  (EOS, stop token ids, max_tokens) finished with that token.
- ("grammar", ((child_id, status, error), ...)): structured-output samples their grammar
  finished after this step's token (complete: "stop"; a dead end: "error").
- ("collect",): the engine collected its outputs here (the frontend does too, so each
  `RequestOutput` spans the same tokens as the one-process engine's).
- ("aborted", request_id): the engine aborted a request (`LLMEngine.abort`, e.g. from
  `abort_older_than`); no output, as in one process.
The core loop adds ("applied", n) (n commands applied when what follows was recorded),
("rejected", request_id, why) for an add that raised, and ("raised", why) for a step
that raised (`jaxserve.engine.core_proc`).

Stop strings are the frontend's: it finds them in the text and sends a "stop" command,
which finishes the request here through `Scheduler.stop_by_string`. A sample's tokens
sampled after that (the core runs a step or two ahead) are dropped by the frontend, so outputs
equal the one-process engine's.
Timestamps are `time.monotonic()`, one clock for every process of the machine.
"""

from __future__ import annotations

from typing import Any, Iterable

from jaxserve.engine.input_processor import ProcessedRequest
from jaxserve.engine.output_processor import FinishRequests, grammar_dead_end
from jaxserve.scheduler.request import Request, RequestStatus
from jaxserve.worker.runner import PromptLogprobs, SampledToken

_FINISHED = RequestStatus.FINISHED_STOPPED  # statuses >= this one are final (the hot
# loop of `process_tokens` compares with it instead of calling `Request.is_finished`)

Event = tuple


class CoreOutputs:
    """`OutputProcessor`'s interface for an engine whose outputs are assembled in another
    process (see the module doc). `take()` hands over the events recorded since the last
    call; `collect` returns no `RequestOutput`s (the frontend makes them)."""

    def __init__(self) -> None:
        self._children: dict[str, list[Request]] = {}  # request id -> its child Requests
        self._parent_of: dict[str, str] = {}  # child id -> request id
        self._req: dict[str, Request] = {}  # child id -> its Request (the scheduler's)
        self._tops: set[str] = set()  # child ids whose tokens carry their top-k arrays
        self._started: dict[str, int] = {}  # request id -> weight version at its add
        self.weight_version = 0
        self.generation_tokens_total = 0
        self.events: list[Event] = []
        self._ended: list[str] = []  # child ids the engine finishes after telling us

    def take(self) -> list[Event]:
        """The events since the last call, oldest first."""
        if self._ended:  # finished by the engine after `advance_grammars` (`_apply`)
            self._forget_finished(self._ended)
            self._ended = []
        events, self.events = self.events, []
        return events

    def ended(self, child_ids: Iterable[str]) -> None:
        """These samples are finished or about to be (forgotten at the next `take`)."""
        self._ended += child_ids

    # ------------------------------------------------------------ bookkeeping
    def add(self, p: ProcessedRequest) -> None:
        self._drop(p.request_id)  # an earlier request of that id, ended but not yet forgotten
        self._children[p.request_id] = list(p.children)
        for req in p.children:
            cid = req.request_id
            self._parent_of[cid], self._req[cid] = p.request_id, req
            if req.sampling_params.logprobs is not None:
                self._tops.add(cid)
        self._started[p.request_id] = self.weight_version

    def live_ids(self) -> frozenset[str]:
        return frozenset(self._children).union(self._parent_of)

    @property
    def num_live(self) -> int:
        return len(self._children)

    def older_than(self, version: int) -> list[str]:
        return [rid for rid, v in self._started.items() if v < version]

    def pop(self, request_id: str) -> list[Request] | None:
        """The engine aborted the request (for the frontend too, if it did not ask)."""
        children = self._drop(request_id)
        if children is not None:
            self.events.append(("aborted", request_id))
        return children

    def _drop(self, request_id: str) -> list[Request] | None:
        children = self._children.pop(request_id, None)
        if children is None:
            return None
        self._started.pop(request_id, None)
        for req in children:
            cid = req.request_id
            del self._parent_of[cid], self._req[cid]
            self._tops.discard(cid)
        return children

    def _forget_finished(self, child_ids: Iterable[str]) -> None:
        """Forget the requests all of whose samples have finished (the frontend collects
        their final outputs from the events)."""
        for pid in {self._parent_of[c] for c in child_ids if c in self._parent_of}:
            if all(r.is_finished for r in self._children[pid]):
                self._drop(pid)

    def request(self, child_id: str) -> Request | None:
        """The live sample `child_id`'s Request, else None."""
        return self._req.get(child_id)

    # ------------------------------------------------------------ per step
    def on_scheduled(self, out: Any, now: float) -> None:
        for nr in out.scheduled_new_reqs:
            pid = self._parent_of.get(nr.request_id)
            if pid is not None:
                self.events.append(("scheduled", pid, now))

    def fail(self, child_ids: Iterable[str], message: str) -> list[str]:
        failed = [(c, int(self._req[c].status)) for c in child_ids if c in self._req]
        if not failed:
            return []
        self.events.append(("fail", tuple(failed), message))
        parents = [self._parent_of[c] for c, _ in failed]
        self._forget_finished(c for c, _ in failed)
        return parents

    def process_prompt_logprobs(self, scored: dict[str, PromptLogprobs]) -> None:
        kept = {cid: pl for cid, pl in scored.items() if cid in self._req}
        if kept:
            self.events.append(("scores", kept))

    def process_tokens(self, sampled: dict[str, SampledToken], now: float
                       ) -> tuple[list[str], FinishRequests]:
        reqs, tops = self._req, self._tops
        cids, ids, lps, top, finished = [], [], [], {}, []
        for cid, tok in sampled.items():
            req = reqs.get(cid)
            if req is None:
                continue
            cids.append(cid)
            ids.append(tok.token_id)
            lps.append(tok.logprob)
            if cid in tops:
                top[cid] = (tok.top_ids, tok.top_logprobs)
            if req.status >= _FINISHED:
                finished.append((cid, int(req.status), req.stop_reason))
        if cids:
            self.generation_tokens_total += len(cids)
            self.events.append(("tokens", self.weight_version, cids, ids, lps, top, finished))
            if finished:
                self._forget_finished(c for c, _, _ in finished)
        return [], FinishRequests()

    def advance_grammars(self, sampled: dict[str, SampledToken]
                         ) -> tuple[list[str], FinishRequests]:
        """`OutputProcessor.advance_grammars`' decisions (the matchers live here, beside
        the scheduler that fills their bitmasks); the frontend flushes the text."""
        fin, done = FinishRequests(), []
        for cid, tok in sampled.items():
            req = self._req.get(cid)
            g = None if req is None else req.grammar
            if g is None:
                continue
            ok = g.accept(tok.token_id)
            if req.is_finished or (ok and not g.is_terminated):
                continue
            status = RequestStatus.FINISHED_STOPPED if ok else RequestStatus.FINISHED_ERROR
            fin.finished.append((cid, status))
            done.append((cid, int(status), None if ok else grammar_dead_end(g, tok.token_id)))
        if done:
            self.events.append(("grammar", tuple(done)))
            self.ended(c for c, _, _ in done)
        return [], fin

    def collect(self, parent_ids: Iterable[Any]) -> list:
        """Marks where the engine collected (the frontend collects there too)."""
        self.events.append(("collect",))
        return []
