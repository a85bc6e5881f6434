"""Output processing: sampled tokens become text, logprobs and `RequestOutput`s.

vLLM V1's OutputProcessor: it owns the per-sample state of every live user
request (incremental detokenizer, logprobs, deltas since the last output) and
the n>1 parent/child grouping, so the n samples of one request come back
together in one `RequestOutput`. It never calls the scheduler: a stop string
matched in the text, a grammar that completes or dead-ends, or a failure of this
host work comes back as a `FinishRequests` signal (vLLM's `reqs_to_abort`), which
the engine applies through the scheduler's API before it collects the outputs: the
request status belongs to the scheduler alone.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from jaxserve.engine.detokenizer import IncrementalDetokenizer, prepare_pieces
from jaxserve.engine.input_processor import ProcessedRequest
from jaxserve.engine.prompt_scores import PromptScores
from jaxserve.sampling_params import RequestOutputKind
from jaxserve.outputs import (CompletionOutput, ListPrefix, RequestMetrics, RequestOutput,
                              VersionRuns)
from jaxserve.scheduler.request import Request, RequestStatus
from jaxserve.worker.runner import PromptLogprobs, SampledToken
from jaxserve.scheduler.output import SchedulerOutput

logger = logging.getLogger(__name__)
_RUNNING = RequestStatus.RUNNING


@dataclass
class FinishRequests:
    """Requests the output processor found finished, for the engine to apply.

    Attributes:
      by_stop_string: requests whose text matched a stop string (`Scheduler.stop_by_string`:
        a live one finishes "stop"; one this step ended by length is relabelled "stop").
      finished: (child request id, status) for `Scheduler.finish_requests`.
    """

    by_stop_string: list[Request] = field(default_factory=list)
    finished: list[tuple[str, RequestStatus]] = field(default_factory=list)


@dataclass
class _Child:
    """Output-side state of one sample (child request) of a user request."""

    request: Request
    index: int
    detok: IncrementalDetokenizer | None
    logprobs: list[dict[int, float]] | None
    token_logprobs: list[float] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    stop_reason: int | str | None = None
    error: str | None = None
    delta_text: str = ""
    delta_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[dict[int, float]] = field(default_factory=list)
    final_sent: bool = False  # an output carrying this sample's finish has been collected
    # Issue 28: (first token index, weight version) runs of the versions its tokens were
    # sampled under (`VersionRuns`); `version` is the last run's.
    version_runs: list[tuple[int, int]] = field(default_factory=list)
    version: int | None = None


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[_Child]
    metrics: RequestMetrics
    scores: PromptScores | None = None
    final_only: bool = False  # RequestOutputKind.FINAL_ONLY: no output until finished
    delta: bool = False  # RequestOutputKind.DELTA: the output fields hold the new part only
    sent: bool = False  # an output has been collected (stream_interval holds the next ones)
    prompt_sent: bool = False  # an output has carried the prompt's logprobs
    # One sample, no logprobs, no prompt scores, every token an output: while its sample
    # runs without a grammar or stop strings, `process_tokens` makes its output at once.
    direct: bool = False
    started_version: int = 0  # the weight version live when the request was added (issue 28)


def _fewer_than(p: _Parent, k: int) -> bool:
    """No sample of `p` has k tokens since its last output, and none has finished since
    (a sample's finish is never held back by its siblings)."""
    return all(len(c.delta_ids) < k and (c.final_sent or not c.request.is_finished)
               for c in p.children)


class OutputProcessor:
    """Per-sample output state of the live user requests.

    Args:
      tokenizer: for the detokenizers; None means token ids only (no text).
      stream_interval: vLLM's: a live request's next output waits until one of its samples
        has this many new tokens (its first output and its final one are never held).

    `weight_version` (the engine's, `LLMEngine.weight_version`) is the version a token
    processed now was sampled under: each completion's `token_weight_versions`.
    """

    def __init__(self, tokenizer: Any, *, stream_interval: int = 1):
        self.tokenizer = tokenizer
        prepare_pieces(tokenizer)  # now, not in the first request's time to first token
        self.stream_interval = stream_interval
        self._parents: dict[str, _Parent] = {}
        self._child_of: dict[str, tuple[str, int]] = {}
        self.generation_tokens_total = 0
        self.weight_version = 0

    # ------------------------------------------------------------ bookkeeping
    def add(self, p: ProcessedRequest) -> None:
        """Start tracking a request the scheduler has accepted."""
        children = []
        for i, req in enumerate(p.children):
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, p.prompt_token_ids, req.sampling_params)
            lps = [] if req.sampling_params.logprobs is not None else None
            children.append(_Child(req, i, detok, lps))
            self._child_of[req.request_id] = (p.request_id, i)
        kind = p.children[0].sampling_params.output_kind
        self._parents[p.request_id] = _Parent(p.request_id, p.prompt, p.prompt_token_ids, children,
                                              RequestMetrics(p.arrival_time),
                                              final_only=kind == RequestOutputKind.FINAL_ONLY,
                                              delta=kind == RequestOutputKind.DELTA,
                                              started_version=self.weight_version)
        start = p.children[0].logprob_start
        parent = self._parents[p.request_id]
        parent.direct = (len(children) == 1 and not parent.final_only and start is None
                         and children[0].logprobs is None and self.stream_interval == 1)
        if start is not None:
            self._parents[p.request_id].scores = PromptScores.empty(
                start, p.children[0].sampling_params.prompt_logprobs, len(p.prompt_token_ids))

    def older_than(self, version: int) -> list[str]:
        """Ids of the live user requests added under a weight version < `version`."""
        return [rid for rid, p in self._parents.items() if p.started_version < version]

    def live_ids(self) -> frozenset[str]:
        """Every live user request id and child id (a snapshot, handed on as data)."""
        return frozenset(self._parents).union(self._child_of)

    @property
    def num_live(self) -> int:
        return len(self._parents)

    def pop(self, request_id: str) -> list[Request] | None:
        """Stop tracking a user request (abort); its child Requests, or None if unknown."""
        p = self._parents.pop(request_id, None)
        if p is None:
            return None
        for c in p.children:
            self._child_of.pop(c.request.request_id, None)
        return [c.request for c in p.children]

    def _child(self, cid: str) -> _Child:
        pid, idx = self._child_of[cid]
        return self._parents[pid].children[idx]

    def _parent(self, cid: str) -> _Parent:
        return self._parents[self._child_of[cid][0]]

    # ------------------------------------------------------------ per step
    def on_scheduled(self, out: SchedulerOutput, now: float) -> None:
        """Stamp first_scheduled_time of the requests in this plan (a request's first
        plan always carries its `NewRequestData`, so only those rows are looked at)."""
        for nr in out.scheduled_new_reqs:
            at = self._child_of.get(nr.request_id)
            if at is not None:
                self.scheduled(at[0], now)

    def fail(self, child_ids: Iterable[str], message: str) -> list[str]:
        """Record `message` as the error of these samples (the scheduler has finished
        them); returns their parents' ids."""
        parents = []
        for cid in child_ids:
            if cid in self._child_of:
                self._child(cid).error = message
                parents.append(self._child_of[cid][0])
        return parents

    def process_prompt_logprobs(self, scored: dict[str, PromptLogprobs]) -> None:
        """Store one step's prompt logprobs by index (before `process_tokens`, so the
        output that carries the first token carries them complete)."""
        for cid, pl in scored.items():
            if cid not in self._child_of:
                continue
            sc = self._parent(cid).scores
            if sc is not None:
                sc.store(pl)

    def process_tokens(self, sampled: dict[str, SampledToken], now: float
                       ) -> tuple[list[str | RequestOutput], FinishRequests]:
        """Apply one step's tokens (the scheduler has appended them); returns what
        progressed, in row order, for `collect`, and the requests to finish (stop strings;
        a failure here, e.g. the detokenizer, fails that sample alone).

        What progressed is a parent id, or already its `RequestOutput` for a live
        `_Parent.direct` request whose sample has no grammar and no stop strings: nothing
        later in the step can change that output (only its own row could finish it), so
        it is made here in the same pass (vLLM V1's OutputProcessor likewise makes each
        output while it processes the token). A FINAL_ONLY sample that is still running
        (no stop string found) is left out: its parent has no output to give yet."""
        progressed, fin = [], FinishRequests()
        child_of, all_parents = self._child_of, self._parents
        for cid, tok in sampled.items():
            at = child_of.get(cid)
            if at is None:
                continue
            p = all_parents[at[0]]
            c = p.children[at[1]]
            try:
                if p.direct:  # the common case in one pass (`_direct_output`)
                    req, d = c.request, c.detok
                    if (req.status is _RUNNING and req.grammar is None and d is not None
                            and d.plain):
                        progressed.append(self._direct_output(c, p, tok.token_id,
                                                              tok.logprob, now))
                        continue
                self._token(at, p, c, tok, now, fin, progressed)
            except Exception as e:  # this request alone fails
                self._token_failed(cid, at, c, e, fin, progressed)
        return progressed, fin

    def _token(self, at: tuple[str, int], p: _Parent, c: _Child, tok: SampledToken,
               now: float, fin: FinishRequests, progressed: list) -> None:
        """`process_tokens` for a token `_direct_output` does not take."""
        self._on_token(c, p, tok, now, fin)
        req = c.request
        if (p.direct and req.status is _RUNNING and req.grammar is None
                and c.detok is None):  # (no tokenizer; else `_direct_output`)
            p.sent = True
            progressed.append(RequestOutput.make(p.request_id, p.prompt, p.prompt_token_ids,
                                                 [self._completion(c, p.delta)], False,
                                                 p.metrics))
        elif not (p.final_only and req.status is _RUNNING and c.stop_reason is None):
            progressed.append(at[0])  # (a live FINAL_ONLY sample has no output yet)

    @staticmethod
    def _token_failed(cid: str, at: tuple[str, int], c: _Child, e: Exception,
                      fin: FinishRequests, progressed: list) -> None:
        """The output processing of sample `cid`'s token raised: it alone fails."""
        logger.exception("output processing failed for %s", cid)
        c.error = f"{type(e).__name__}: {e}"
        fin.finished.append((cid, RequestStatus.FINISHED_ERROR))
        progressed.append(at[0])

    def _direct_output(self, c: _Child, p: _Parent, tid: int, lp: float, now: float
                       ) -> RequestOutput:
        """`_on_token` then `RequestOutput.make` of `[_completion(c, p.delta)]` for the
        sample of a `_Parent.direct` request that runs with a plain detokenizer and no
        grammar (checked by the caller), in one pass: the same fields, the same order of
        state changes (a detokenizer error leaves the sample as `_on_token` would)."""
        self.generation_tokens_total += 1
        if c.version != self.weight_version:  # (compared inline: once a row a step)
            _new_version_run(c, self.weight_version)
        m = p.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.token_times.append(now)  # (one sample: c.index == 0)
        c.cumulative_logprob += lp
        tlp = c.token_logprobs
        tlp.append(lp)
        d = c.detok
        try:
            text = d.update_one(tid)
        except Exception:
            c.delta_ids.append(tid)  # where `_on_token` had put it; the caller fails the sample
            raise
        p.sent = True
        if p.delta:
            k = len(tlp)
            comp = CompletionOutput.snapshot(
                c.index, text, [tid], text, [tid], None, None, [lp], c.cumulative_logprob,
                None, c.stop_reason, c.error, VersionRuns(c.version_runs, k, k - 1))
        else:
            full, n = d.text, d.num_emitted
            ids = c.request.output_token_ids
            k = len(ids)
            comp = CompletionOutput.snapshot(
                c.index, full if n == len(full) else ListPrefix(full, n),
                ListPrefix(ids, k), text, [tid], None, None, ListPrefix(tlp, len(tlp)),
                c.cumulative_logprob, None, c.stop_reason, c.error,
                VersionRuns(c.version_runs, k))
        return RequestOutput.make(p.request_id, p.prompt, p.prompt_token_ids, [comp], False,
                                  p.metrics)

    def _on_token(self, c: _Child, p: _Parent, tok: SampledToken, now: float,
                  fin: FinishRequests) -> None:
        self.generation_tokens_total += 1
        if c.version != self.weight_version:
            _new_version_run(c, self.weight_version)
        if p.metrics.first_token_time is None:
            p.metrics.first_token_time = now
        if c.index == 0:
            p.metrics.token_times.append(now)
        keep = not p.final_only  # a FINAL_ONLY sample's deltas are its whole output, made once
        if keep:
            c.delta_ids.append(tok.token_id)
        c.cumulative_logprob += tok.logprob
        c.token_logprobs.append(tok.logprob)
        if c.logprobs is not None:
            k = c.request.sampling_params.logprobs or 0
            entry = {int(t): float(lp) for t, lp in zip(tok.top_ids[:k], tok.top_logprobs[:k])}
            entry[tok.token_id] = tok.logprob
            c.logprobs.append(entry)
            if keep:
                c.delta_logprobs.append(entry)
        req, d = c.request, c.detok
        if d is not None:
            if d.plain and req.status is _RUNNING:
                text = d.update_one(tok.token_id)  # the common case, inlined
            else:
                text = self._stop_checked_text(c, tok, fin)
            if keep:
                c.delta_text += text
        if req.is_finished and c.stop_reason is None:
            c.stop_reason = req.stop_reason

    @staticmethod
    def _stop_checked_text(c: _Child, tok: SampledToken, fin: FinishRequests) -> str:
        """The new text of `tok` through the detokenizer's full update (stop strings,
        finishes); a stop string found finishes the request through `fin`."""
        # FINISHED_STOPPED here means EOS or a stop token id (stop strings come below):
        # that token's text is not output unless include_stop_str_in_output (vLLM).
        req = c.request
        upd = c.detok.update([tok.token_id], finished=req.is_finished,
                             stop_terminated=req.status == RequestStatus.FINISHED_STOPPED)
        text = upd.delta_text
        if upd.stop_string is not None:
            c.stop_reason = upd.stop_string
            fin.by_stop_string.append(req)
            if not req.is_finished:  # live until the engine applies `fin`: flush now
                text += c.detok.update([], finished=True).delta_text
        return text

    def advance_grammars(self, sampled: dict[str, SampledToken]
                         ) -> tuple[list[str], FinishRequests]:
        """Advance the grammar matcher of each structured-output sample by its accepted
        token (after `process_tokens`'s finishes are applied); returns the parents it
        finished and how.

        A grammar that is complete (nothing may follow) finishes a live request with
        "stop", its last token's text kept; a token the grammar rejects (a dead end, e.g.
        the only allowed token was suppressed) finishes it with "error" and says why.
        """
        parents, fin = [], FinishRequests()
        for cid, tok in sampled.items():
            if cid not in self._child_of:
                continue
            c = self._child(cid)
            g = c.request.grammar
            if g is None:
                continue
            ok = g.accept(tok.token_id)
            if c.request.is_finished:  # EOS, length, a stop string or an error: done anyway
                continue
            if ok and not g.is_terminated:
                continue
            error = None if ok else grammar_dead_end(g, tok.token_id)
            fin.finished.append((cid, RequestStatus.FINISHED_STOPPED if ok
                                 else RequestStatus.FINISHED_ERROR))
            parents.append(self.end_by_grammar(cid, error))
        return parents, fin

    def end_by_grammar(self, cid: str, error: str | None) -> str:
        """Sample `cid`'s grammar finished it after its last token ("error" when `error`):
        its text is flushed, that token's text kept. Returns its parent's id."""
        c = self._child(cid)
        if error is not None:
            c.error = error
        if c.detok is not None:
            c.delta_text += c.detok.update([], finished=True).delta_text
        return self._child_of[cid][0]

    # ------------------------------------------------------------ a frontend's
    def request(self, cid: str) -> Request | None:
        """The live sample `cid`'s Request (in a frontend process, its own copy, which
        `jaxserve.engine.core_client` keeps up to date from the engine core's events)."""
        at = self._child_of.get(cid)
        return None if at is None else self._parents[at[0]].children[at[1]].request

    def requests_of(self, request_id: str) -> list[Request]:
        """The Requests of a live user request's samples ([] if unknown)."""
        p = self._parents.get(request_id)
        return [] if p is None else [c.request for c in p.children]

    def scheduled(self, request_id: str, now: float) -> None:
        """Stamp the request's first_scheduled_time (`on_scheduled`, told by an engine core)."""
        p = self._parents.get(request_id)
        if p is not None and p.metrics.first_scheduled_time is None:
            p.metrics.first_scheduled_time = now

    def collect(self, parent_ids: Iterable[str | RequestOutput]) -> list[RequestOutput]:
        """One `RequestOutput` per parent (deduplicated, in order), deltas since the last one;
        a finished parent is forgotten. A FINAL_ONLY parent gets one only once finished
        (its deltas then span the whole output); with `stream_interval` k > 1 a live parent
        that has had an output gets the next once a sample has k new tokens. An entry that
        is already a `RequestOutput` (`process_tokens`) is passed on in its place."""
        outs = []
        parents, completion, k = self._parents, self._completion, self.stream_interval
        seen = set()
        for pid in parent_ids:
            if type(pid) is RequestOutput:
                outs.append(pid)
                continue
            if pid in seen:
                continue
            seen.add(pid)
            p = parents.get(pid)
            if p is None:
                continue
            finished = all(c.request.is_finished for c in p.children)
            if not finished and (p.final_only or (k > 1 and p.sent and _fewer_than(p, k))):
                continue
            if finished and p.final_only:
                for c in p.children:
                    _whole_output_as_delta(c)
            comps = [completion(c, p.delta) for c in p.children]
            if finished:
                p.metrics.finished_time = time.monotonic()
                self.pop(pid)
            p.sent = True
            ro = RequestOutput.make(pid, p.prompt, p.prompt_token_ids, comps, finished, p.metrics)
            sc = p.scores
            if sc is not None and sc.complete and not (p.delta and p.prompt_sent):
                p.prompt_sent = True  # DELTA (vLLM's): the prompt's logprobs come once
                ro.prompt_token_logprobs = sc.logprobs
                if sc.k is not None:
                    ro.prompt_logprobs = sc.entries_for(p.prompt_token_ids)
            outs.append(ro)
        return outs

    @staticmethod
    def _completion(c: _Child, delta: bool = False) -> CompletionOutput:
        # Every cumulative field is a snapshot made in O(1): the token and logprob lists are
        # append-only and the text an immutable str, so a `ListPrefix` (copied when read)
        # equals a copy made now. `snapshot` skips the dataclass's per-field setters.
        # RequestOutputKind.DELTA (vLLM's): text, token_ids, logprobs and token_logprobs
        # hold only what is new since the last output (cumulative_logprob stays cumulative).
        # token_weight_versions: a `VersionRuns` view of the sample's version runs.
        # The text is a str: when all of it is emitted (no stop-string hold-back) it is
        # handed out as is, else as a ListPrefix of its emitted part.
        ids, req, d, lps, tlp = (c.request.output_token_ids, c.request, c.detok, c.logprobs,
                                 c.token_logprobs)
        if delta:
            tids, lp = list(c.delta_ids), None if lps is None else list(c.delta_logprobs)
            text = c.delta_text
            k = len(tlp)
            tlp = tlp[k - len(tids):]
            versions = VersionRuns(c.version_runs, k, k - len(tids))
        else:
            if d is None:
                text = ""
            else:
                text, n = d.text, d.num_emitted
                if n != len(text):
                    text = ListPrefix(text, n)
            tids, tlp = ListPrefix(ids, len(ids)), ListPrefix(tlp, len(tlp))
            lp = None if lps is None else ListPrefix(lps, len(lps))
            versions = VersionRuns(c.version_runs, len(ids))
        reason = req.finish_reason
        out = CompletionOutput.snapshot(
            c.index, text, tids, c.delta_text, c.delta_ids, lp,
            None if lps is None else c.delta_logprobs, tlp, c.cumulative_logprob,
            reason, c.stop_reason, c.error, versions)
        c.delta_text, c.delta_ids = "", []
        if lps is not None:
            c.delta_logprobs = []
        if reason is not None:
            c.final_sent = True
        return out


def _new_version_run(c: _Child, version: int) -> None:
    """Sample `c`'s next token (index len(token_logprobs)) is the first sampled under
    weight `version`."""
    c.version = version
    c.version_runs.append((len(c.token_logprobs), version))


def grammar_dead_end(g: Any, token_id: int) -> str:
    """The error of a structured-output sample whose token the grammar `g` rejected."""
    return (f"structured output ({g.spec.kind}): token {token_id} does not continue the "
            f"grammar (dead end): {g.error}")


def _whole_output_as_delta(c: _Child) -> None:
    """A finished FINAL_ONLY sample (whose deltas were not kept): its deltas become its
    whole output, as the cumulative fields are."""
    d, lps = c.detok, c.logprobs
    c.delta_text = d.output_text if d is not None else ""
    c.delta_ids = list(c.request.output_token_ids)
    c.delta_logprobs = [] if lps is None else list(lps)
