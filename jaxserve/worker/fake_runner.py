"""The one fake runner: scripted, deterministic tokens and no model.

JetStream's habit: test the orchestration with a mock engine whose
arithmetic can be checked by hand. `FakeRunner` implements the `Runner`
protocol (`jaxserve.worker.runner`), so it plugs into a real `LLMEngine` (engine and
server tests without a model, in milliseconds), and it can also drive a bare
`Scheduler` by itself: `step()` is one iteration (schedule -> execute ->
update_from_output) and `run()` loops it over a workload with arrival times
on a simulated clock (scheduler tests, `bench buckets --dry_run`).

Token functions map (request, output position) to a token id or a full
`SampledToken`: `default_token` (a hash), `scripted` (fixed lists) and
`counting_token` (the next id counts up from the last one, with hand-checkable
logprobs; the server tests use it). Plain Python + NumPy: no jax.
"""

from __future__ import annotations

import functools
import time
import zlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from jaxserve.config import max_blocks_per_seq
from jaxserve.worker.input_batch import BatchArrays, CachedRequestState, RequestStates, build_batch
from jaxserve.scheduler.request import Request, RequestStatus
from jaxserve.worker.runner import (NO_TOP_IDS, NO_TOP_LOGPROBS, RowError, RowResult,
                                    RunnerStats, SampledToken)
from jaxserve.scheduler.buckets import BucketPolicy
from jaxserve.scheduler.output import SchedulerOutput
from jaxserve.scheduler.scheduler import Scheduler
from jaxserve.worker.scoring import fake_scores, merge_scores, scoring_plan

if TYPE_CHECKING:
    from jaxserve.config import EngineConfig

# The hooks see the runner's copy of a request (`CachedRequestState`: request_id,
# prompt_token_ids, output_token_ids, sampling_params, seed,
# num_prompt_tokens, num_output_tokens, num_computed_tokens after the plan).
TokenFn = Callable[[CachedRequestState, int], "int | SampledToken"]
RequestPredicate = Callable[[CachedRequestState], bool]


_M32 = 0xFFFFFFFF


def _mix32(h, pos):
    """MurmurHash3's 32-bit finalizer over h ^ (pos * golden ratio), for Python ints or
    uint64 NumPy arrays alike (every product is masked back to 32 bits)."""
    x = (h ^ (pos * 0x9E3779B1)) & _M32
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & _M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def default_token(request_id: str, output_pos: int, *, vocab_size: int = 1000, low: int = 3) -> int:
    """A deterministic pseudo-random token in [low, vocab_size) for (request_id, position).

    Depends on nothing else (not the batch, the step or a preemption), like
    a seeded sampler keyed on (seed, output position). `default_tokens` gives the same
    values for a whole step at once.
    """
    return low + int(_mix32(_id_hash(request_id), output_pos)) % (vocab_size - low)


@functools.lru_cache(maxsize=1 << 16)
def _id_hash(request_id: str) -> int:
    return zlib.crc32(request_id.encode())


def default_tokens(request_ids: Sequence[str], output_pos: Sequence[int], *,
                   vocab_size: int = 1000, low: int = 3) -> np.ndarray:
    """i64[len(request_ids)]: `default_token` of each (request_id, output_pos) pair, the
    hash done in NumPy (the fake device's sampler: a step's tokens cost the host
    O(1) Python calls a row, as a real device's do)."""
    h = np.fromiter(map(_id_hash, request_ids), np.uint64, len(request_ids))
    pos = np.asarray(output_pos, np.uint64)
    return low + (_mix32(h, pos) % np.uint64(vocab_size - low)).astype(np.int64)


def scripted(script: Mapping[str, Sequence[int]], fallback: TokenFn | None = None) -> TokenFn:
    """Token function that emits script[request_id][output_pos] (fallback past the end)."""
    def fn(req: CachedRequestState, pos: int) -> int | SampledToken:
        s = script.get(req.request_id)
        if s is not None and pos < len(s):
            return s[pos]
        if fallback is None:
            raise KeyError(f"no scripted token for {req.request_id!r} at output {pos}")
        return fallback(req, pos)
    return fn


def counting_token(vocab_size: int, max_logprobs: int) -> TokenFn:
    """Tokens that count up from the last token, with hand-checkable logprobs.

    Output `pos` is `(last + s) % vocab_size`, `last` being the token before it
    (the last prompt token for pos 0). The step s is 1 when greedy (temperature
    0 or top_k 1), else `2 + seed % 5` with the request's resolved seed (a
    seeded n>1 sample i has seed + i, vLLM's convention; an unseeded request
    draws its seed at random). The chosen token's logprob is -0.1 * s; the
    j-th alternative (j = 1..max_logprobs) is `(last + s + j) % vocab_size`
    with logprob -(0.1 * s + j). So greedy "abc" on a character vocabulary
    whose letters are consecutive ids continues "defgh".
    """
    j = np.arange(1, max_logprobs + 1)

    def fn(req: CachedRequestState, pos: int) -> SampledToken:
        last = req.output_token_ids[pos - 1] if pos else req.prompt_token_ids[-1]
        s = 1 if req.sampling_params.is_greedy else 2 + req.seed % 5
        return SampledToken(token_id=(last + s) % vocab_size, logprob=-0.1 * s,
                            top_ids=((last + s + j) % vocab_size).astype(np.int32),
                            top_logprobs=-(0.1 * s + j).astype(np.float32))
    return fn


@dataclass
class StepResult:
    """One `FakeRunner.step()`: the plan, the tokens applied, who finished, the arrays
    (when `build_batches`) and the simulated clock at the end of the step."""

    out: SchedulerOutput
    sampled: dict[str, int]
    finished: list[Request]
    batch: BatchArrays | None
    clock: float = 0.0


class FakeRunner:
    """A `Runner` with scripted tokens; optionally the driver of a bare scheduler.

    Args:
      scheduler: the scheduler `step()` / `run()` drive (None when an engine drives).
      token_fn: (request, output_pos) -> token id or SampledToken; default `default_token`.
      num_kv_blocks: the pool size reported to an engine (default: the scheduler's).
      max_logprobs: width of the top_ids / top_logprobs of int tokens.
      bucket_policy: the shapes `warmup()` reports as ready (default: the scheduler's).
      block_size / max_blocks_per_seq: the layout of `build_batches` (default:
        the scheduler's).
      build_batches: lay out the padded arrays each step (exercises
        `jaxserve.worker.input_batch.build_batch` exactly as the model runner does); the
        last layout is `last_batch`.
      check_invariants: check the scheduler's bookkeeping after every
        schedule() and update (slow; for tests).
      on_step: callback(StepResult) after every `step()`.
      step_delay: D, the seconds of a simulated device step. The device is a FIFO
        queue: a step starts at max(its dispatch, the end of the step before) and ends
        D later; `execute` then waits for its end without using the CPU (sleeps).
        `device_busy_s` sums D over the steps run; `device_wait_s` the time `execute`
        spent waiting for it (more than D when the OS wakes the sleeper late).
      fail_step: a predicate; `execute` raises RuntimeError when a row's request
        matches (fault injection: a failed device step).
      fail_row: a predicate; a matching row gets a RowError (a failed row).
      kv_lost_on_reset: what `reset()` reports (a failed step lost the KV cache).
      vocab_size: V of a structured-output row's bitmask; with it, a row whose request
        has a grammar obeys its mask: the scripted token if allowed, else the next
        allowed id above it (cyclically), as a masked sampler would pick some allowed id.
      score: whether `warmup()` reports score programs (prompt logprobs on); scoring rows
        get hand-checkable scores (`jaxserve.worker.scoring.fake_scores`) over `vocab_size` ids
        (1000 without it).
    """

    def __init__(self, scheduler: Scheduler | None = None, *, token_fn: TokenFn | None = None,
                 num_kv_blocks: int | None = None, max_logprobs: int = 0,
                 bucket_policy: BucketPolicy | None = None, block_size: int | None = None,
                 max_blocks_per_seq: int | None = None, build_batches: bool = False,
                 check_invariants: bool = False, on_step: Callable[[StepResult], None] | None = None,
                 step_delay: float = 0.0, fail_step: RequestPredicate | None = None,
                 fail_row: RequestPredicate | None = None, kv_lost_on_reset: bool = False,
                 vocab_size: int | None = None, score: bool = True):
        self.scheduler = scheduler
        self._default_fn = lambda req, pos: default_token(req.request_id, pos)
        self.token_fn = token_fn or self._default_fn
        if scheduler is not None:
            num_kv_blocks = num_kv_blocks or scheduler.kv_cache_manager.num_kv_blocks
            bucket_policy = bucket_policy or scheduler.bucket_policy
            block_size = block_size or scheduler.block_size
            max_blocks_per_seq = max_blocks_per_seq or scheduler.max_blocks_per_seq
        if build_batches and not (block_size and max_blocks_per_seq):
            raise ValueError("build_batches needs block_size and max_blocks_per_seq "
                             "(or a scheduler to take them from)")
        self.num_kv_blocks = num_kv_blocks or 0
        self.token_cap: int | None = None  # `Runner.token_cap`; tests set it to cap steps
        self.max_logprobs = max_logprobs
        self.bucket_policy = bucket_policy
        self.block_size, self.max_blocks_per_seq = block_size, max_blocks_per_seq
        self.build_batches = build_batches
        self.check = check_invariants
        self.on_step = on_step
        self.step_delay = step_delay
        self.fail_step, self.fail_row = fail_step, fail_row
        self.kv_lost_on_reset = kv_lost_on_reset
        self.vocab_size, self.score = vocab_size, score
        self.num_resets = 0
        self.last_batch: BatchArrays | None = None
        self.finished: dict[str, Request] = {}
        self.clock = 0.0
        # the running requests, from the plans (and, building batches, their block table)
        self.requests = RequestStates(max_blocks_per_seq if build_batches else None)
        self.device_busy_s = self.device_wait_s = 0.0
        self._device_free_at = 0.0  # time.perf_counter() when the simulated device is idle
        self._stats = RunnerStats()
        self.asleep: set[str] = set()  # the SLEEP_TAGS a sleep freed (no memory to free)
        # take plans made ahead (`placeholders_ok`); as `ModelRunner.placeholders`, but on
        # by default: the simulated device is not the host's cores
        self.placeholders = True

    @classmethod
    def for_config(cls, config: "EngineConfig", **kw) -> "FakeRunner":
        """A fake for an `LLMEngine` built from `config` (`cache.num_kv_blocks` must be
        set): pool size, layout, logprob width and buckets all from the config."""
        if config.cache.num_kv_blocks is None:
            raise ValueError("FakeRunner.for_config needs cache.num_kv_blocks (there is no "
                             "device memory to size the pool from)")
        sc = config.scheduler
        kw.setdefault("max_logprobs", config.max_logprobs)
        kw.setdefault("vocab_size", config.model.vocab_size)
        kw.setdefault("score", config.enable_prompt_logprobs)
        bs = config.cache.block_size
        return cls(num_kv_blocks=config.cache.num_kv_blocks, bucket_policy=BucketPolicy.from_config(sc),
                   block_size=bs, max_blocks_per_seq=max_blocks_per_seq(sc.max_model_len, bs), **kw)

    # ------------------------------------------------------------ Runner protocol
    def warmup(self, *, progress: bool = True) -> None:
        """Nothing to compile; reports the policy's programs (T_pad stacks + S_pad heads) as ready."""
        if self.bucket_policy is not None:
            self._stats.warmup_programs = len(self.bucket_policy.program_keys(score=self.score))
            self._stats.programs_ready = self._stats.warmup_programs
        self._stats.warmup_done = True

    def execute(self, out: SchedulerOutput) -> dict[str, RowResult]:
        """Scripted tokens for the plan's sampling rows (see `jaxserve.worker.runner.Runner`).

        Raises:
          RuntimeError: a row's request matches `fail_step`.
          ValueError: the plan does not fit its bucket or block table (from build_batch).
        """
        return self.dispatch(out).result()

    def dispatch(self, out: SchedulerOutput) -> "_FakePending":
        """`execute`'s host half (the layout, the scripted tokens) and the simulated
        device step's dispatch; the handle's `result()` waits for the step's end
        (`Runner.dispatch`). Raises as `execute`."""
        states, missing = self.requests.update(out)
        if not out.scheduled:
            return _FakePending(self, out, {}, None)
        if self.asleep:  # as ModelRunner: nothing runs without its memory
            raise RuntimeError("FakeRunner.execute: the runner is asleep; wake_up() first")
        if self.build_batches:
            self.last_batch = build_batch(out, block_size=self.block_size,
                                          max_blocks_per_seq=self.max_blocks_per_seq,
                                          table=self.requests.block_table,
                                          slots=self.requests.table_rows(states))
        results: dict[str, RowResult] = {rid: RowError(m) for rid, m in missing.items()}
        grammar = out.grammar
        masks = grammar.rows() if grammar is not None else {}
        sample = []  # (row, state): their tokens are made in `result()`, as on a device
        for sr, req in zip(out.scheduled, states):
            if req is None:
                continue
            if self.fail_step is not None and self.fail_step(req):
                raise RuntimeError(f"scripted step failure caused by {sr.request_id}")
            if self.fail_row is not None and self.fail_row(req):
                results[sr.request_id] = RowError("scripted request failure")
            elif grammar is not None and sr.request_id in grammar.errors:
                results[sr.request_id] = RowError(grammar.errors[sr.request_id])
            elif sr.sample:
                results[sr.request_id] = None  # its place in row order; made in `result()`
                sample.append((sr, req))
        plan = scoring_plan(out, self.requests)
        end = None
        if self.step_delay:  # FIFO: starts when dispatched or when the step before ends
            start = max(time.perf_counter(), self._device_free_at)
            self._device_free_at = end = start + self.step_delay
            self.device_busy_s += self.step_delay
        return _FakePending(self, out, results, end, sample, masks, plan)

    def placeholders_ok(self) -> bool:
        """Whether the next plan may be made before this step's tokens are back (its rows
        reading them as placeholders; `jaxserve.engine.core`): `placeholders` on and, as
        `ModelRunner`, `RequestStates.plan_ahead_ok`.
        The fake makes a step's tokens when it is fetched, so a placeholder row sees the
        token the step before made."""
        return self.placeholders and self.requests.plan_ahead_ok()

    def _make_tokens(self, results: dict[str, RowResult], sample: list, masks: dict,
                     plan: Any, tops: bool = True) -> None:
        """The step's scripted tokens (and prompt scores), made once the steps before it
        have recorded theirs."""
        # the default token function (not replaced since): a step hashed at once
        if self.token_fn is self._default_fn and not masks and sample:
            rids = [sr.request_id for sr, _ in sample]
            ids = default_tokens(rids, [sr.output_pos for sr, _ in sample])
            self._wrap_tokens(results, rids, ids, tops)
        else:
            for sr, req in sample:
                results[sr.request_id] = self._token(req, sr.output_pos, masks.get(sr.request_id))
            self._batch_alternatives(results)
        if plan is not None:
            merge_scores(results, fake_scores(plan, vocab_size=self.vocab_size or 1000,
                                              max_logprobs=self.max_logprobs))

    def _wait_device(self, end: float) -> None:
        """Block until the simulated device reaches `end` (perf_counter seconds), sleeping."""
        now = time.perf_counter()
        if end - now > 3e-4:  # sleep most of it; yield through the rest (timer slack)
            time.sleep(end - now - 2e-4)
        while time.perf_counter() < end:
            time.sleep(0)
        self.device_wait_s += time.perf_counter() - now

    def _token(self, req: CachedRequestState, pos: int, allowed: np.ndarray | None
               ) -> "SampledToken | int":
        """The scripted token (an int until `_batch_alternatives` wraps it)."""
        t = self.token_fn(req, pos)
        if allowed is not None and self.vocab_size:
            t = self._obey_grammar(allowed, t)
        return t if isinstance(t, SampledToken) else int(t)

    def _batch_alternatives(self, results: dict[str, Any]) -> None:
        """Wrap each plain int token as a SampledToken (logprob 0, every alternative the
        token itself), their arrays rows of one step-wide array, as the real runner's
        are rows of the fetched batch."""
        rids = [rid for rid, t in results.items() if type(t) is int]
        if rids:
            self._wrap_tokens(results, rids, np.fromiter((results[r] for r in rids), np.int32,
                                                         len(rids)))

    def _wrap_tokens(self, results: dict[str, Any], rids: list[str], ids: np.ndarray,
                     tops: bool = True) -> None:
        """results[rids[i]] = the SampledToken of ids[i]: logprob 0, every alternative the
        token itself (a row of one step-wide array), the top logprobs one shared
        read-only zero row."""
        make = SampledToken
        if not tops:  # no request of the step asked for logprobs: nobody reads them
            for rid, t in zip(rids, ids.tolist()):
                results[rid] = make(t, 0.0, NO_TOP_IDS, NO_TOP_LOGPROBS)
            return
        L = self.max_logprobs
        top = list(np.repeat(ids.astype(np.int32), L).reshape(len(rids), L))
        zero = np.zeros(L, np.float32)
        zero.flags.writeable = False
        for rid, t, row in zip(rids, ids.tolist(), top):
            results[rid] = make(t, 0.0, row, zero)

    def _obey_grammar(self, row: np.ndarray, t: "int | SampledToken") -> "int | SampledToken":
        """The scripted token if the bitmask `row` allows it, else the next allowed id."""
        V = self.vocab_size
        allowed = np.nonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:V])[0]
        tid = t.token_id if isinstance(t, SampledToken) else int(t)
        if tid in allowed:
            return t
        later = allowed[allowed > tid]
        new = int(later[0] if later.size else allowed[0])
        return replace(t, token_id=new) if isinstance(t, SampledToken) else new

    def reset(self) -> bool:
        """Counts the call; returns `kv_lost_on_reset`."""
        self.num_resets += 1
        return self.kv_lost_on_reset

    def stats(self) -> RunnerStats:
        """Steps run per shape; no compile counters (nothing is compiled)."""
        return self._stats

    def sleep(self, level: int, *, discard_weights: bool = False) -> None:
        """Record what a sleep frees ("kv_cache"; level 2 also "weights"); nothing to free."""
        self.asleep = {"kv_cache", "weights"} if level == 2 else {"kv_cache"}

    def wake_up(self, tags: tuple[str, ...]) -> None:
        self.asleep -= set(tags)

    @property
    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    # ------------------------------------------------------------ driving a bare scheduler
    def step(self, step_time: Callable[[SchedulerOutput], float] | None = None) -> StepResult:
        """One iteration over `self.scheduler`: schedule -> execute -> update_from_output.

        Row errors finish their requests with FINISHED_ERROR. `step_time(plan)`
        advances the simulated clock before `on_step` sees the result.
        """
        s = self.scheduler
        if s is None:
            raise ValueError("FakeRunner.step() needs the scheduler it drives (scheduler=None)")
        out = s.schedule(self.token_cap)
        if self.check:
            check_invariants(s)
        results = self.execute(out)
        errors = [rid for rid, r in results.items() if isinstance(r, RowError)]
        finished = s.finish_requests(errors, RequestStatus.FINISHED_ERROR) if errors else []
        sampled = {rid: r.token_id for rid, r in results.items() if isinstance(r, SampledToken)}
        finished += s.update_from_output(out, sampled)
        if self.check:
            check_invariants(s)
        for r in finished:
            self.finished[r.request_id] = r
        if step_time is not None:
            self.clock += step_time(out)
        res = StepResult(out, sampled, finished, self.last_batch if self.build_batches else None,
                         self.clock)
        if self.on_step is not None:
            self.on_step(res)
        return res

    def run(self, arrivals: Iterable[tuple[float, Request]] = (), *, max_steps: int = 100_000,
            step_time: Callable[[SchedulerOutput], float] | float = 0.0) -> dict[str, Request]:
        """Run until every request (queued and arriving) has finished.

        Args:
          arrivals: (arrival time in simulated seconds, request) pairs; each is
            added once the clock reaches its time (stable order on ties).
          max_steps: a livelock guard.
          step_time: simulated seconds one step takes (a constant or a
            function of the plan, e.g. a cost model of the padded shape).

        Returns: request_id -> finished Request, for everything finished so far.

        Raises:
          RuntimeError: more than max_steps steps (the scheduler did not finish).
          ValueError: the scheduler rejects an arriving request.
        """
        s = self.scheduler
        pending = sorted(arrivals, key=lambda a: a[0])
        i = 0
        cost = step_time if callable(step_time) else (lambda out: float(step_time))
        for _ in range(max_steps):
            while i < len(pending) and pending[i][0] <= self.clock:
                s.add_request(pending[i][1])
                i += 1
            if not s.has_unfinished_requests():
                if i == len(pending):
                    return self.finished
                self.clock = pending[i][0]
                continue
            self.step(cost)
        raise RuntimeError(f"not finished after max_steps={max_steps} steps: "
                           f"{s.num_running} running, {s.num_waiting} waiting")


class _FakePending:
    """`FakeRunner.dispatch`'s handle: `result()` waits for the simulated device step."""

    __slots__ = ("runner", "out", "results", "end", "sample", "masks", "plan", "tops")

    def __init__(self, runner: FakeRunner, out: SchedulerOutput, results: dict[str, RowResult],
                 end: float | None, sample: list = (), masks: dict | None = None,
                 plan: Any = None):
        self.runner, self.out, self.results, self.end = runner, out, results, end
        self.sample, self.masks, self.plan = sample, masks or {}, plan
        # decided at dispatch, as `ModelPending`: a plan made ahead may drop a logprobs
        # request before this step's tokens are made
        self.tops = bool(runner.requests.num_logprobs)

    def result(self) -> dict[str, RowResult]:
        r, out = self.runner, self.out
        if out.scheduled:
            if self.end is not None:
                r._wait_device(self.end)
            r._make_tokens(self.results, self.sample, self.masks, self.plan, self.tops)
            r._stats.record_step(out.token_bucket, out.seq_bucket)
            r.requests.record(out.scheduled, self.results)
        return self.results


def check_invariants(s: Scheduler) -> None:
    """Assert the scheduler's and the pool's bookkeeping agree (tests, debugging)."""
    kv = s.kv_cache_manager
    kv.check_invariants(s.requests)
    owners = kv.owners()
    B = s.block_size
    running_ids = {r.request_id for r in s.running}
    waiting_ids = {r.request_id for r in s.waiting}
    assert len(running_ids) == len(s.running) and not running_ids & waiting_ids
    assert running_ids | waiting_ids == set(s.requests), "a live request is lost"
    # Planned ahead, a request whose last token is on its way gives its seat up early.
    finishing = sum(r.last_output_on_its_way for r in s.running)
    assert len(s.running) - finishing <= s.config.max_num_seqs
    for r in s.running:
        assert r.status == RequestStatus.RUNNING
        blocks = owners.get(r.request_id, ())
        assert len(blocks) * B >= r.num_computed_tokens, f"{r} has too few blocks"
        # Blocks still to be written are held by this request alone and uncached.
        for b in blocks[r.num_computed_tokens // B:]:
            assert kv.ref_count(b) == 1 and not kv.is_cached(b), f"{r}: block {b} shared"
    for r in s.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.num_computed_tokens == 0 and r.request_id not in owners
