"""The iteration-level scheduler: before every forward pass, who runs and how much.

Orca (Yu et al., OSDI'22) schedules per iteration; vLLM V1 dropped the
prefill/decode phases: each request has `num_computed_tokens` and a token
list, and a step hands it tokens until the two meet. Chunked prefill, decode
and the re-prefill of a preempted request are then one operation. Order of
one `schedule()` (stall-free batching, Sarathi-Serve OSDI'24):

1. RUNNING requests, decodes (one token left) first, then the chunks of
   requests still prefilling, within `max_num_batched_tokens`. When one
   cannot get its next block, the least important running request is
   preempted by recompute (FCFS: the last admitted; priority: the largest
   (priority, arrival)): blocks freed, `num_computed_tokens = 0`, back to the front
   of the waiting queue; its tokens are kept, so the resumed run recomputes prompt +
   outputs and samples nothing until it reaches the end.
2. WAITING requests, only if nobody was preempted this step, with what is
   left of the budget, up to `max_num_seqs` running, and only when
   `can_allocate` says all their blocks for this step exist.

The oldest running request is never preempted by another, and every request fits
the pool alone (`add_request`): the oldest always progresses, no livelock. Plain
Python: no jax import anywhere in this package.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Iterable, Mapping, Sequence

from jaxserve.config import CacheConfig, SchedulerConfig, max_blocks_per_seq
from jaxserve.scheduler.request import Request, RequestStatus, resolve_max_tokens
from jaxserve.scheduler.buckets import BucketPolicy
from jaxserve.scheduler.kv_cache_manager import KVCacheManager
from jaxserve.scheduler.output import (PLACEHOLDER_TOKEN_ID, NewRequestData, ScheduledRequest,
                                       SchedulerOutput, align_sampled, make_grammar_output)
from jaxserve.scheduler.pause_control import MAX_STEP_RETRIES, PauseControl  # noqa: F401
from jaxserve.scheduler.request_queue import FCFSQueue, PriorityQueue

_RUNNING = RequestStatus.RUNNING


class Scheduler(PauseControl):
    """Continuous-batching scheduler over a paged, prefix-cached KV pool.

    Args:
      scheduler_config: token budget, max_num_seqs, max_model_len, policy,
        long_prefill_token_threshold, static_batching.
      cache_config: block_size, num_kv_blocks (must be set), prefix caching.
      bucket_policy: (T_pad, S_pad) padding; default
        `BucketPolicy.from_config(scheduler_config)`. Its largest token bucket
        must equal max_num_batched_tokens and its largest sequence bucket be
        >= max_num_seqs. The scheduler records every step in its counters.

    Raises:
      ValueError: num_kv_blocks is None, or buckets that do not match the limits.

    The engine alternates `schedule()` and `update_from_output()`; calling
    `schedule()` again while a non-empty plan still has live requests waiting
    for their tokens raises RuntimeError (their tokens would be lost), except once with
    `ahead=True` (async scheduling with output placeholders, vLLM V1's): step n+1 is
    planned before step n's tokens are back, each decode row whose input is step n's
    token reading `PLACEHOLDER_TOKEN_ID`; the two plans are then applied in order.
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, *,
                 bucket_policy: BucketPolicy | None = None):
        if cache_config.num_kv_blocks is None:
            raise ValueError("CacheConfig.num_kv_blocks=None: the scheduler needs the pool size "
                             "(resolve it from kv_cache_memory_bytes first)")
        self.config = scheduler_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            cache_config.num_kv_blocks, cache_config.block_size,
            enable_prefix_caching=cache_config.enable_prefix_caching)
        policy = bucket_policy or BucketPolicy.from_config(scheduler_config)
        policy.check_limits(scheduler_config)
        self.bucket_policy = policy
        self.max_blocks_per_seq = max_blocks_per_seq(scheduler_config.max_model_len, self.block_size)
        self.waiting = PriorityQueue() if scheduler_config.policy == "priority" else FCFSQueue()
        self.running: list[Request] = []  # admission order (priority: sorted by key)
        self.requests: dict[str, Request] = {}  # live (unfinished) requests
        self.num_preemptions = 0
        self._seq = itertools.count()
        self._order: dict[str, int] = {}  # request_id -> add order (tie-break)
        self._finished_ids: list[str] = []
        self._force_preempt: list[str] = []
        self._unsent: set[str] = set()  # running, its NewRequestData not yet in a plan
        self._pending_out: SchedulerOutput | None = None
        self._ahead_of: SchedulerOutput | None = None  # the plan before a plan made ahead
        self._step = 0

    # ------------------------------------------------------------ queries
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def pending_output(self) -> SchedulerOutput | None:
        """The last non-empty plan not yet passed to update_from_output, if any."""
        return self._pending_out

    def get_request(self, request_id: str) -> Request | None:
        """The live request, or None (unknown, or already finished and handed back)."""
        return self.requests.get(request_id)

    # ------------------------------------------------------------ admission
    def add_request(self, request: Request) -> None:
        """Validate and queue a new request, resolving `request.max_tokens` as vLLM does:
        None becomes `max_model_len - num_prompt_tokens`; a larger value is CLAMPED to it.

        Raises:
          ValueError: a duplicate live request_id, a request that is not new, an empty
            prompt, a prompt of >= max_model_len tokens (no position left for an output),
            max_tokens < 1, or prompt + max_tokens needing more KV blocks than the pool
            has (it could never run). Nothing is queued when it raises.
        """
        if not isinstance(request, Request):
            raise ValueError(f"add_request expects a Request, got {type(request).__name__}")
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request_id={rid!r} is already in use by a live request")
        if request.status != RequestStatus.WAITING or request.output_token_ids:
            raise ValueError(f"request {rid!r} is not new (status {request.status.name}, "
                             f"{request.num_output_tokens} outputs)")
        mt = resolve_max_tokens(request, self.config.max_model_len, self.block_size,
                                self.kv_cache_manager.num_blocks)
        request.max_tokens = mt
        self.requests[rid] = request
        self._order[rid] = next(self._seq)
        self.waiting.push(request)

    # ------------------------------------------------------------ scheduling
    def schedule(self, token_cap: int | None = None, *, ahead: bool = False,
                 defer_commits: bool = False) -> SchedulerOutput:
        """Plan one step of at most `bucket_policy.token_budget(token_cap)` tokens;
        advances num_computed_tokens of every scheduled request.

        `ahead`: the previous plan's tokens may still be out (async scheduling, issue 24):
        a request whose last row samples gets a decode row reading a placeholder (its
        `output_pos` counts the token on its way), unless that token is its last by
        max_tokens; a row whose block would need a placeholder's token to hash is not
        marked pending for the prefix cache. The plans must be applied in order.
        `defer_commits` (with `ahead`): the plan in flight's prefix-cache registration waits
        for the caller's `commit_deferred` (`_commit_inputs`); the same cache either way.

        Raises:
          RuntimeError: the previous plan's live requests still await `update_from_output`
            (with `ahead`: two plans already do).
        """
        prev = self._pending_out
        if prev is not None:
            if any(sr.request_id in self.requests for sr in prev.scheduled):
                if not ahead or self._ahead_of is not None:
                    raise RuntimeError(f"schedule() called before update_from_output() for "
                                       f"step {prev.step}; its sampled tokens would be lost")
                self._ahead_of = prev
                self._commit_inputs(prev, defer=defer_commits)
            self._pending_out = None
        self._step += 1
        # request_id -> (request, tokens this step), in row order
        scheduled: dict[str, tuple[Request, int]] = {}
        preempted: list[Request] = []
        pending: set[bytes] = set()  # hashes of blocks this step fills (not yet hittable)
        for rid in self._force_preempt:
            req = self.requests.get(rid)
            if req is not None and req.status == _RUNNING:
                self.running.remove(req)
                self._preempt(req)
                preempted.append(req)
        self._force_preempt.clear()
        static = self.config.static_batching
        if static and not self.running and not preempted:
            self._admit_static_batch()
        budget, finishing = self._schedule_running(self.bucket_policy.token_budget(token_cap),
                                                   scheduled, preempted, pending)
        if not preempted and not static:
            self._schedule_waiting(budget, scheduled, pending, finishing)
        return self._make_output(scheduled, preempted)

    def _chunk(self, n: int, budget: int) -> int:
        thr = self.config.long_prefill_token_threshold
        return min(n, thr, budget) if thr else min(n, budget)

    def _schedule_running(self, budget: int, scheduled: dict[str, tuple[Request, int]],
                          preempted: list[Request], pending: set[bytes]) -> tuple[int, int]:
        """Schedule the running requests; returns (budget left, how many gave their seat up
        because their last token is on its way)."""
        kv = self.kv_cache_manager
        try_allocate = kv.try_allocate
        caching = kv.enable_prefix_caching
        B = self.block_size
        thr = self.config.long_prefill_token_threshold
        chunks: list[Request] = []  # requests with > 1 token left, served after all decodes
        finishing = 0  # running, their last token on its way: their seats are free
        for req in list(self.running):  # a copy: preemption pops from the tail
            if req.status is not _RUNNING:  # preempted earlier in this loop
                continue
            c = req.num_computed_tokens
            ph = req.num_output_placeholders  # > 0 only when planning ahead
            if ph and req.last_output_on_its_way:
                finishing += 1  # it finishes by length once that token is applied, and
                continue  # its seat can go to a waiting request now
            if len(req.all_token_ids) + ph - c > 1:
                chunks.append(req)
            elif budget > 0:
                if try_allocate(req, 1):
                    scheduled[req.request_id] = (req, 1)
                    budget -= 1
                    if caching and (c + 1) % B == 0 and not ph:
                        self._note_pending(req, 1, pending)
                else:
                    budget = self._preempt_for(req, 1, budget, scheduled, preempted, pending)
        for req in chunks:
            if budget <= 0:
                break
            if req.status is not _RUNNING:
                continue
            c = req.num_computed_tokens
            n = len(req.all_token_ids) - c
            if thr and n > thr:
                n = thr
            if n > budget:
                n = budget
            if try_allocate(req, n):
                scheduled[req.request_id] = (req, n)
                budget -= n
                if caching and (c + n) // B > c // B:
                    self._note_pending(req, n, pending)
            else:
                budget = self._preempt_for(req, n, budget, scheduled, preempted, pending)
        return budget, finishing

    def _preempt_for(self, req: Request, n: int, budget: int,
                     scheduled: dict[str, tuple[Request, int]], preempted: list[Request],
                     pending: set[bytes]) -> int:
        """Preempt from the tail of `running` until req's n tokens get blocks (or req itself
        is preempted); a victim already scheduled this step gives its budget back."""
        kv = self.kv_cache_manager
        while True:
            victim = self.running.pop()  # the least important request
            budget += scheduled.pop(victim.request_id, (None, 0))[1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return budget
            if kv.try_allocate(req, n):
                break
        scheduled[req.request_id] = (req, n)
        if kv.enable_prefix_caching and not req.num_output_placeholders:
            self._note_pending(req, n, pending)
        return budget - n

    def _schedule_waiting(self, budget: int, scheduled: dict[str, tuple[Request, int]],
                          pending: set[bytes], finishing: int = 0) -> None:
        kv = self.kv_cache_manager
        max_seqs = self.config.max_num_seqs + finishing
        deferred: list[Request] = []
        while len(self.waiting) and budget > 0 and len(self.running) < max_seqs:
            req = self.waiting.peek()
            if req.num_output_placeholders:  # preempted with its last token still out:
                break  # it resumes once that token is back (the next plan)
            hits, n_hit = kv.get_computed_blocks(req)
            if pending and self._fills_pending_block(req, len(hits), pending):
                # A block of its prefix is being computed this step by another
                # request (e.g. an n>1 sibling): admit it next step as a hit.
                deferred.append(self.waiting.pop())
                continue
            n = self._chunk(req.num_tokens - n_hit, budget)
            if not kv.can_allocate(req, n, hits):
                break  # FCFS head-of-line: later requests must not starve it
            self.waiting.pop()
            kv.allocate(req, n, hits)
            kv.record_lookup(req.num_tokens, n_hit)
            req.num_computed_tokens = n_hit
            self._set_running(req)
            scheduled[req.request_id] = (req, n)
            budget -= n
            if kv.enable_prefix_caching:
                self._note_pending(req, n, pending)
        for req in reversed(deferred):
            self.waiting.push_front(req)

    def _admit_static_batch(self) -> None:
        """Static batching: admit as many as fit at full length, then nobody until all finish.

        Each admitted request reserves blocks for prompt + max_tokens, so the
        batch never preempts; the running loop then prefills and decodes it.
        """
        kv = self.kv_cache_manager
        free = kv.num_free_blocks
        while len(self.waiting) and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            footprint = kv.blocks_for_tokens(req.num_prompt_tokens + req.max_tokens - 1)
            if footprint > free:
                break
            free -= footprint
            self.waiting.pop()
            hits, n_hit = kv.get_computed_blocks(req)
            kv.allocate(req, 0, hits)
            kv.record_lookup(req.num_tokens, n_hit)
            req.num_computed_tokens = n_hit
            self._set_running(req)

    def _fills_pending_block(self, req: Request, n_hits: int, pending: set[bytes]) -> bool:
        if n_hits >= (req.num_tokens - 1) // self.block_size:
            return False
        return self.kv_cache_manager.block_hashes(req, n_hits + 1)[n_hits] in pending

    def _note_pending(self, req: Request, n: int, pending: set[bytes]) -> None:
        B = self.block_size
        first, end = req.num_computed_tokens // B, (req.num_computed_tokens + n) // B
        if end > first:
            pending.update(self.kv_cache_manager.block_hashes(req, end)[first:end])

    def _set_running(self, req: Request) -> None:
        req.status = _RUNNING
        self._unsent.add(req.request_id)
        if self.config.policy == "priority":
            bisect.insort(self.running, req, key=self._priority_key)
        else:
            self.running.append(req)

    def _priority_key(self, req: Request) -> tuple[int, float, int]:
        return (req.priority, req.arrival_time, self._order[req.request_id])

    def _make_output(self, scheduled: dict[str, tuple[Request, int]],
                     preempted: list[Request]) -> SchedulerOutput:
        rows = []
        total = 0
        block_ids = self.kv_cache_manager.get_block_ids
        make = ScheduledRequest
        new, unsent, grammar = [], self._unsent, []
        for rid, (req, n) in scheduled.items():
            if rid in unsent:
                unsent.discard(rid)
                new.append(NewRequestData.from_request(req))
            c = req.num_computed_tokens
            end = c + n
            toks = req.all_token_ids
            L, ph = len(toks), req.num_output_placeholders
            if end <= L:
                ids = (toks[c],) if n == 1 else tuple(toks[c:end])
            else:  # planned ahead: the last input is a token still on its way
                ids = tuple(toks[c:L]) + (PLACEHOLDER_TOKEN_ID,) * (end - L)
            sample = end == L + ph
            rows.append(make(rid, ids, c, block_ids(rid), sample, len(req.output_token_ids) + ph))
            if sample:
                req.num_output_placeholders = ph + 1
                if req.grammar is not None:
                    grammar.append((rid, req.grammar))
            req.num_computed_tokens = end
            total += n
        t_pad, s_pad = self.bucket_policy.record(total, len(rows)) if rows else (0, 0)
        out = SchedulerOutput(tuple(rows), total, t_pad, s_pad,
                              tuple(r.request_id for r in preempted), tuple(self._finished_ids),
                              self._step, tuple(new), make_grammar_output(grammar))
        self._finished_ids = []
        self._pending_out = out if rows else None
        return out

    # ------------------------------------------------------------ results
    def update_from_output(self, out: SchedulerOutput,
                           sampled_token_ids: Mapping[str, int] | Sequence[int]) -> list[Request]:
        """Apply one step's sampled tokens; return the requests it finished.

        Args:
          out: the plan returned by the last `schedule()` (with a plan made ahead, the
            one before it).
          sampled_token_ids: request_id -> token id for every row with
            sample=True, or a sequence indexed by row (entries of rows with
            sample=False are ignored). Rows of requests finished or aborted
            since `schedule()` are skipped.

        Appends each token, registers newly full blocks in the prefix cache,
        applies the stop rules (`Request.check_stop`) and frees the blocks of
        finished requests. With a plan made ahead (`schedule(ahead=True)`), `out` is the
        older of the two pending plans.

        Raises:
          ValueError: `out` is not the (oldest) pending plan, or a sampled token is missing.
        """
        older = self._ahead_of
        if out is not (older if older is not None else self._pending_out):
            if not any(sr.request_id in self.requests for sr in out.scheduled):
                return []  # nothing live to apply (a later schedule() dropped the plan)
            raise ValueError(f"update_from_output(step={out.step}) does not match the pending "
                             "plan (already applied, or not the oldest schedule())")
        rows = out.scheduled
        reqs = self.requests
        toks = align_sampled(out, sampled_token_ids, reqs)  # validated before any change
        if older is not None:
            self._ahead_of = None
        else:
            self._pending_out = None
        kv = self.kv_cache_manager
        commit = kv.commit if kv.enable_prefix_caching else None
        B = self.block_size
        finished = []
        for i, sr in enumerate(rows):
            req = reqs.get(sr.request_id)
            if req is None:  # finished or aborted since schedule()
                continue
            status = None
            if sr.sample:
                if req.num_output_placeholders:
                    req.num_output_placeholders -= 1
                status = req.append_and_check(int(toks[i]))
            # After the append: a plan made ahead may have advanced num_computed_tokens over
            # this token's position. Not for a request that plan preempted (no blocks).
            if commit is not None and req.status is _RUNNING:
                s = sr.start_pos
                if (s + len(sr.token_ids)) // B > s // B:
                    commit(req)
            if status is not None:
                self._finish(req, status)
                finished.append(req)
        return finished

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status == _RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.kv_cache_manager.free(req.request_id)
        req.status = status
        rid = req.request_id
        del self.requests[rid]
        self._order.pop(rid, None)
        self._unsent.discard(rid)
        self._finished_ids.append(rid)

    def finish_requests(self, request_ids: str | Iterable[str],
                        status: RequestStatus) -> list[Request]:
        """Finish requests in any state (stop string, abort, error); frees their blocks now.

        Unknown or already finished ids are ignored. Returns the requests finished.

        Raises:
          ValueError: status is not a FINISHED_* status.
        """
        if not RequestStatus.is_finished(status):
            raise ValueError(f"status={status!r} must be a FINISHED_* status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req, status)
                done.append(req)
        return done

    def stop_by_string(self, request: Request) -> None:
        """A stop string matched the request's text: a live request finishes
        FINISHED_STOPPED now; one this step finished by length is relabelled so (vLLM
        reports "stop" when the stop string completes on the last allowed token)."""
        if self.requests.get(request.request_id) is request:
            self._finish(request, RequestStatus.FINISHED_STOPPED)
        elif request.status == RequestStatus.FINISHED_LENGTH:
            request.status = RequestStatus.FINISHED_STOPPED

    def reset_prefix_cache(self, *, stale_held: bool = False) -> int:
        """Forget the cached prefix blocks no request holds (`stale_held`: held ones too,
        see `KVCacheManager.reset_prefix_cache`); returns how many."""
        return self.kv_cache_manager.reset_prefix_cache(stale_held=stale_held)

    def abort(self, request_id: str) -> bool:
        """Abort a request in any state (waiting, running, mid-chunk, preempted).

        Frees its blocks at once; returns False if it is unknown or finished.
        """
        return bool(self.finish_requests((request_id,), RequestStatus.FINISHED_ABORTED))

    def preempt(self, request_id: str) -> bool:
        """Test hook (C05): preempt a running request at the next schedule() (which admits
        nobody); False when it is not running now (it may still be preempted then)."""
        req = self.requests.get(request_id)
        if req is None:
            raise ValueError(f"preempt: unknown or finished request_id={request_id!r}")
        self._force_preempt.append(request_id)
        return req.status == _RUNNING
