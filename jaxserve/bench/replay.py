"""Replay a trace through the scheduler: with a fake runner (dry run) or the real engine.

Both paths return a `ReplayResult` with the same fields, so bucket policies
and batching modes are compared on one footing:

- `dry_run`: the real `Scheduler` and `BucketPolicy`, driven by the one
  `FakeRunner` sampling a fixed token for every row that samples (JetStream's
  mock-engine idea). Steps, the tokens-per-step histogram and the padding are exactly
  those of the engine when every request is present from the start
  (`respect_arrivals=False`); with arrivals the clock is a step-cost model
  (`StepCost`), so TTFT/TPOT/throughput are modeled, not measured.
- `engine_run`: an `LLMEngine` stepped in real time, requests added when
  their `arrival_s` has passed; everything is measured.

Plain Python + NumPy here; jax is only touched through the engine passed in.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from jaxserve.bench.traces import (CHAT_OVERHEAD_TOKENS, TraceRequest, approx_prompt_tokens,
                                   percentiles)
from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.scheduler.request import Request
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler.buckets import BucketPolicy
from jaxserve.scheduler.scheduler import Scheduler
from jaxserve.worker.fake_runner import FakeRunner

FAKE_TOKEN = 5  # what the fake runner samples; runs ignore EOS, so any id works


@dataclass(frozen=True)
class StepCost:
    """Modeled seconds of one step:
    fixed_ms + per_token_ms * max(T_pad, knee_tokens) + per_seq_ms * S_pad.

    The defaults are a linear fit of BASELINES.md's XLA probe of SmolLM2-135M
    fp32 on the 2-core CPU (27.1 ms at 8 rows, 36.5 at 16, 75.3 at 64:
    ~20 ms + 0.86 ms per token) with the LM head's share (~20% of a row's
    FLOPs) moved to the per-sequence term. The knee: the same probe found a
    1-row step (34.4 ms, XLA's matrix-vector path) no cheaper than an 8-row
    one, so token buckets below 8 save nothing on this CPU. Recalibrate with
    measured steps (`--step_cost_ms`); a model, never a measurement.
    """

    fixed_ms: float = 20.0
    per_token_ms: float = 0.69
    per_seq_ms: float = 0.17
    knee_tokens: int = 8

    def seconds(self, t_pad: int, s_pad: int) -> float:
        t = max(t_pad, self.knee_tokens)
        return (self.fixed_ms + self.per_token_ms * t + self.per_seq_ms * s_pad) / 1e3

    @classmethod
    def parse(cls, text: str) -> "StepCost":
        """'FIXED,PER_TOKEN[,PER_SEQ[,KNEE]]' in milliseconds (KNEE in tokens).

        Raises:
          ValueError: not 2-4 comma-separated non-negative numbers.
        """
        try:
            vals = [float(x) for x in text.split(",")]
        except ValueError:
            raise ValueError(f"step cost {text!r} must be FIXED_MS,PER_TOKEN_MS[,PER_SEQ_MS[,KNEE]]") from None
        if not 2 <= len(vals) <= 4 or any(v < 0 for v in vals):
            raise ValueError(f"step cost {text!r} must be 2 to 4 non-negative numbers")
        if len(vals) == 4:
            vals[3] = int(vals[3])
        return cls(*vals)


@dataclass
class ReplayResult:
    """One replay of a trace.

    Fields:
      duration_s: wall time (engine) or modeled time (dry run) from the first
        arrival to the last token.
      steps: forward passes run (non-empty schedules).
      bucket_stats: `BucketPolicy.stats()` for the run (per token bucket:
        steps, real_tokens, padded_tokens, padding_fraction).
      tokens_per_step: histogram num_scheduled_tokens -> steps.
      row_steps: sum over steps of rows that sampled a token (useful rows).
      slot_steps: sum over steps of the batch width (`slots`): the seeds'
        denominator B * steps.
      ttft / tpot / e2el: per finished request, seconds.
    """

    mode: str
    num_requests: int
    output_tokens: int
    duration_s: float
    steps: int
    bucket_stats: dict[str, Any]
    tokens_per_step: Counter
    row_steps: int
    slot_steps: int
    preemptions: int
    real_seqs: int = 0     # sum over steps of num_seqs
    padded_seqs: int = 0   # sum over steps of S_pad
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    e2el: list[float] = field(default_factory=list)
    ttft_by_id: dict[str, float] = field(default_factory=dict)
    step_times: list[tuple[int, int, float]] = field(default_factory=list)  # (T_pad, S_pad, s)

    def summary(self) -> dict[str, Any]:
        """JSON-ready numbers (latencies in ms)."""
        bs = self.bucket_stats
        return {
            "mode": self.mode, "requests": self.num_requests, "output_tokens": self.output_tokens,
            "duration_s": self.duration_s, "steps": self.steps,
            "output_tokens_per_s": self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0,
            "padding_fraction": bs["padding_fraction"], "real_tokens": bs["real_tokens"],
            "padded_tokens": bs["padded_tokens"],
            "per_bucket": {str(b): v for b, v in bs["token_buckets"].items()},
            "row_step_utilisation": self.row_steps / self.slot_steps if self.slot_steps else 0.0,
            "seq_padding_fraction": 1 - self.real_seqs / self.padded_seqs if self.padded_seqs else 0.0,
            "preemptions": self.preemptions,
            "ttft_ms": {k: v * 1e3 for k, v in percentiles(self.ttft, (50, 99)).items()},
            "tpot_ms": {k: v * 1e3 for k, v in percentiles(self.tpot, (50, 99)).items()},
            "e2el_ms": {k: v * 1e3 for k, v in percentiles(self.e2el, (50, 99)).items()},
            "step_ms_by_shape": _by_shape(self.step_times),
        }


def _by_shape(records: Sequence[tuple[int, int, float]]) -> dict[str, dict[str, float]]:
    acc: dict[tuple[int, int], list[float]] = {}
    for t, s, sec in records:
        acc.setdefault((t, s), []).append(sec)
    return {f"{t},{s}": {"steps": len(v), "median_ms": float(np.median(v)) * 1e3}
            for (t, s), v in sorted(acc.items())}


def fit_step_cost(records: Sequence[tuple[int, int, float]], knee_tokens: int = 8) -> StepCost:
    """Least-squares StepCost from measured (T_pad, S_pad, seconds) steps.

    Raises:
      ValueError: fewer than 3 distinct shapes (the 3 coefficients are underdetermined).
    """
    shapes = {(t, s) for t, s, _ in records}
    if len(shapes) < 3:
        raise ValueError(f"fit_step_cost needs >= 3 distinct (T_pad, S_pad) shapes, got {sorted(shapes)}")
    a = np.array([[1.0, max(t, knee_tokens), s] for t, s, _ in records])
    y = np.array([sec * 1e3 for _, _, sec in records])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    return StepCost(*(max(0.0, float(c)) for c in coef), knee_tokens=knee_tokens)


def prompt_ids_for(rows: Sequence[TraceRequest], tokenizer: Any | None, *, vocab_size: int,
                   chat: bool = True) -> list[list[int]]:
    """Prompt token ids per request.

    With a tokenizer: the real ids (chat template applied when `chat`), so
    prefix-cache hits are the engine's. Without: `approx_prompt_tokens` ids
    (or the row's `prompt_tokens`), made of a shared CHAT_OVERHEAD_TOKENS-long
    prefix (the template's fixed system prompt) and a body derived from a hash
    of the prompt text, so equal prompts share blocks as they would for real.
    """
    out = []
    for r in rows:
        if tokenizer is not None and r.prompt_tokens is None:
            if chat:
                ids = tokenizer.apply_chat_template([{"role": "user", "content": r.prompt}],
                                                    add_generation_prompt=True, tokenize=True)
            else:
                ids = tokenizer.encode(r.prompt, add_special_tokens=True)
            out.append(list(ids))
            continue
        n = r.prompt_tokens if r.prompt_tokens is not None else approx_prompt_tokens(r.prompt, chat=chat)
        seed = hashlib.sha256(r.prompt.encode()).digest()
        head = [3 + (i % (vocab_size - 3)) for i in range(min(n, CHAT_OVERHEAD_TOKENS if chat else 0))]
        body = [3 + (seed[i % 32] * 131 + i) % (vocab_size - 3) for i in range(n - len(head))]
        out.append(head + body)
    return out


def _sampling(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)


def dry_run(rows: Sequence[TraceRequest], prompt_ids: Sequence[Sequence[int]],
            sched_cfg: SchedulerConfig, cache_cfg: CacheConfig, *,
            policy: BucketPolicy | None = None, cost: StepCost = StepCost(),
            respect_arrivals: bool = True, slots: int | None = None,
            on_step: Callable[[Any], None] | None = None) -> ReplayResult:
    """Replay `rows` through the real Scheduler with the `FakeRunner`; no model runs.

    Args:
      rows / prompt_ids: the trace and each request's prompt ids.
      sched_cfg / cache_cfg: limits; `cache_cfg.num_kv_blocks` must be set.
      policy: bucket policy (default: from sched_cfg); its counters are reset.
      cost: modeled step time; advances the clock that arrivals are read against.
      respect_arrivals: False adds every request at time 0.
      slots: batch width for row-step utilisation (default max_num_seqs).
      on_step: called with each non-empty SchedulerOutput (for tests).

    Raises:
      ValueError: the scheduler rejects a request (prompt too long for
        max_model_len, more blocks than the pool).
      RuntimeError: the run does not finish within FakeRunner.run's step guard
        (a livelock would be a bug).
    """
    policy = policy or BucketPolicy.from_config(sched_cfg)
    policy.reset_stats()
    sched = Scheduler(sched_cfg, cache_cfg, bucket_policy=policy)
    arrivals = [(r.arrival_s if respect_arrivals else 0.0,
                 Request(r.id, prompt_ids[i], _sampling(r.max_tokens), eos_token_ids=(2,),
                         arrival_time=r.arrival_s if respect_arrivals else 0.0))
                for i, r in enumerate(rows)]
    arrival = {req.request_id: t for t, req in arrivals}
    hist: Counter = Counter()
    acc = {"steps": 0, "rows": 0, "seqs_real": 0, "seqs_pad": 0}
    times: dict[str, list[float]] = {rid: [] for rid in arrival}
    res_ttft, res_tpot, res_e2el, ttft_by_id = [], [], [], {}

    def note(res) -> None:
        out = res.out
        if out.is_empty:
            return
        acc["steps"] += 1
        hist[out.num_scheduled_tokens] += 1
        acc["seqs_real"] += out.num_seqs
        acc["seqs_pad"] += out.seq_bucket
        acc["rows"] += len(res.sampled)
        for rid in res.sampled:
            times[rid].append(res.clock)
        if on_step is not None:
            on_step(out)
        for req in res.finished:
            t = times.pop(req.request_id)
            ttft_by_id[req.request_id] = t[0] - arrival[req.request_id]
            res_ttft.append(t[0] - arrival[req.request_id])
            res_e2el.append(t[-1] - arrival[req.request_id])
            if len(t) > 1:
                res_tpot.append((t[-1] - t[0]) / (len(t) - 1))

    runner = FakeRunner(sched, token_fn=lambda req, pos: FAKE_TOKEN, on_step=note)
    runner.run(arrivals, max_steps=10**8,
               step_time=lambda out: cost.seconds(out.token_bucket, out.seq_bucket)
               if out.scheduled else 0.0)
    steps, width = acc["steps"], slots or sched_cfg.max_num_seqs
    t_first = min(arrival.values()) if arrival else 0.0
    return ReplayResult("dry_run", len(rows), acc["rows"], runner.clock - t_first, steps,
                        policy.stats(), hist, acc["rows"], steps * width, sched.num_preemptions,
                        real_seqs=acc["seqs_real"], padded_seqs=acc["seqs_pad"], ttft=res_ttft,
                        tpot=res_tpot, e2el=res_e2el, ttft_by_id=ttft_by_id)


@contextlib.contextmanager
def observe_schedules(scheduler: Scheduler, sink: list) -> Iterator[None]:
    """Append every SchedulerOutput the engine's scheduler returns to `sink` (benchmark probe)."""
    orig = scheduler.schedule

    def recording(token_cap=None, **kw):  # kw: `ahead`
        out = orig(token_cap, **kw)
        if not out.is_empty:
            sink.append(out)
        return out

    scheduler.schedule = recording  # instance attribute shadows the method
    try:
        yield
    finally:
        del scheduler.schedule


def engine_run(engine: Any, rows: Sequence[TraceRequest], *, respect_arrivals: bool = True,
               chat: bool = True, slots: int | None = None,
               prompt_ids: Sequence[Sequence[int]] | None = None) -> ReplayResult:
    """Replay `rows` through a warmed-up `LLMEngine` in real time; everything measured.

    Requests are added once `arrival_s` seconds have passed since the start
    (all at once when not `respect_arrivals`), greedy with ignore_eos, as chat
    messages when `chat` (else the raw prompt), or as `prompt_ids` when given.
    The engine must be idle; it is idle again on return.
    """
    if engine.has_unfinished_requests():
        raise ValueError("engine_run needs an idle engine (it has unfinished requests)")
    policy = engine.bucket_policy
    policy.reset_stats()
    log: list = []
    pre0 = engine.scheduler.num_preemptions
    pending = deque(sorted(range(len(rows)), key=lambda i: rows[i].arrival_s if respect_arrivals else 0))
    outs: dict[str, Any] = {}
    step_times: list[tuple[int, int, float]] = []
    t0 = time.monotonic()
    with observe_schedules(engine.scheduler, log):
        while pending or engine.has_unfinished_requests():
            now = time.monotonic() - t0
            while pending and (not respect_arrivals or rows[pending[0]].arrival_s <= now):
                i = pending.popleft()
                r = rows[i]
                arr = t0 + (r.arrival_s if respect_arrivals else 0.0)
                if prompt_ids is not None:
                    engine.add_request(r.id, list(prompt_ids[i]), _sampling(r.max_tokens), arrival_time=arr)
                elif chat:
                    engine.add_request(r.id, params=_sampling(r.max_tokens), arrival_time=arr,
                                       messages=[{"role": "user", "content": r.prompt}])
                else:
                    engine.add_request(r.id, r.prompt, _sampling(r.max_tokens), arrival_time=arr)
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, rows[pending[0]].arrival_s - (time.monotonic() - t0)))
                continue
            n_before = len(log)
            ts = time.perf_counter()
            step_outs = engine.step()
            if len(log) > n_before:
                step_times.append((log[-1].token_bucket, log[-1].seq_bucket, time.perf_counter() - ts))
            for o in step_outs:
                if o.finished:
                    outs[o.request_id] = o
    wall = time.monotonic() - t0
    hist = Counter(o.num_scheduled_tokens for o in log)
    row_steps = sum(sum(1 for sr in o.scheduled if sr.sample) for o in log)
    width = slots or engine.config.scheduler.max_num_seqs
    res = ReplayResult("engine", len(rows), sum(o.num_generated_tokens for o in outs.values()),
                       wall, len(log), policy.stats(), hist, row_steps, len(log) * width,
                       engine.scheduler.num_preemptions - pre0,
                       real_seqs=sum(o.num_seqs for o in log), padded_seqs=sum(o.seq_bucket for o in log),
                       step_times=step_times)
    for rid, o in outs.items():
        m = o.metrics
        if m.ttft is not None:
            res.ttft.append(m.ttft)
            res.ttft_by_id[rid] = m.ttft
        if m.tpot is not None:
            res.tpot.append(m.tpot)
        if m.e2el is not None:
            res.e2el.append(m.e2el)
    return res
