"""Prometheus metrics of one server app (names follow vLLM's, prefix `jaxserve:`).

Each app owns a fresh `CollectorRegistry` (never the process-global one), so
tests can build several apps in one process. Two sources feed it:

* the engine's `get_stats()` snapshot, taken by the loop thread after every
  step and exported at scrape time by a custom collector (gauges, and counters
  whose totals the engine already keeps: tokens, preemptions, prefix-cache
  queries/hits, per-bucket steps / real / padded tokens, compiles);
* per-request `RequestMetrics` timestamps, observed into histograms when a
  request finishes (TTFT, inter-token latency, end-to-end latency, queue time),
  plus the per-step token count (`iteration_tokens_total`).
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from jaxserve.server.async_engine import RequestDelta

P = "jaxserve:"

# Latency buckets (seconds) as in vLLM: fine below 1 s, coarse up to minutes.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# (stats key, metric name, help) for gauges and counters read from get_stats().
_GAUGES = (
    ("num_running", "num_requests_running", "Requests in the running set."),
    ("num_waiting", "num_requests_waiting", "Requests waiting to be scheduled."),
    ("kv_cache_usage", "kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)."),
    ("num_free_blocks", "num_free_blocks", "Free KV-cache blocks."),
    ("num_total_blocks", "num_total_blocks", "KV-cache blocks in the pool."),
    ("warmup_seconds", "warmup_seconds", "Wall seconds spent warming up (compiling buckets)."),
    ("warmup_programs", "warmup_programs", "Step programs compiled at warm-up."),
    ("programs_ready", "programs_ready", "Warm-up programs ready so far (progressive warm-up)."),
    ("programs_total", "programs_total", "Programs warm-up builds in all."),
    ("warmup_done", "warmup_done", "1 once every warm-up program is ready."),
)
_COUNTERS = (
    ("prompt_tokens_total", "prompt_tokens", "Prefill tokens processed."),
    ("generation_tokens_total", "generation_tokens", "Tokens generated."),
    ("num_preemptions", "num_preemptions", "Requests preempted (recompute)."),
    ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    ("num_steps", "num_steps", "Engine steps run."),
    ("num_compiles", "num_compiles", "XLA compilations of step programs."),
    ("compile_seconds", "compile_seconds", "Wall seconds spent compiling."),
    ("num_compiles_after_warmup", "num_compiles_after_warmup",
     "Compilations after warm-up (should stay 0)."),
    # Added by AsyncEngine, not the engine: step() calls that raised.
    ("engine_step_failures", "engine_step_failures",
     "engine.step() calls that raised (their in-flight requests were failed)."),
)
_BUCKET_COUNTERS = (
    ("steps", "bucket_steps", "Engine steps run at this token bucket."),
    ("real_tokens", "bucket_real_tokens", "Real tokens computed at this token bucket."),
    ("padded_tokens", "bucket_padded_tokens",
     "Padded token slots at this token bucket, as the engine reports them."),
)


def token_bucket_stats(stats: dict) -> dict[int, dict]:
    """{token_bucket: {"steps", "real_tokens", "padded_tokens"}} from a get_stats() dict.

    Accepts the flat form and BucketPolicy.stats()'s form, which nests the
    per-bucket counters under "token_buckets".
    """
    buckets = stats.get("bucket_stats") or {}
    buckets = buckets.get("token_buckets", buckets)
    return {b: v for b, v in buckets.items() if isinstance(v, dict)}


class _EngineStatsCollector(Collector):
    """Exports the latest `get_stats()` snapshot at scrape time."""

    def __init__(self, stats_source: Callable[[], dict]):
        self._source = stats_source

    def collect(self):
        stats = self._source() or {}
        for key, name, doc in _GAUGES:
            if key in stats:
                yield GaugeMetricFamily(P + name, doc, value=float(stats[key]))
        for key, name, doc in _COUNTERS:
            if key in stats:
                yield CounterMetricFamily(P + name, doc, value=float(stats[key]))
        buckets = token_bucket_stats(stats)
        for key, name, doc in _BUCKET_COUNTERS:
            fam = CounterMetricFamily(P + name, doc, labels=["token_bucket"])
            for bucket in sorted(buckets):
                fam.add_metric([str(bucket)], float(buckets[bucket].get(key, 0)))
            yield fam


class ServerMetrics:
    """The metrics of one app; `render()` gives the Prometheus text exposition.

    Args:
      stats_source: returns the engine's latest `get_stats()` dict (read at scrape).
    """

    def __init__(self, stats_source: Callable[[], dict]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.registry.register(_EngineStatsCollector(stats_source))
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token.",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Gap between successive tokens.",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to finish.",
                             buckets=_E2E_BUCKETS, registry=r)
        self.queue_time = Histogram(P + "request_queue_time_seconds",
                                    "Arrival to first scheduled.", buckets=_E2E_BUCKETS,
                                    registry=r)
        self.iteration_tokens = Histogram(P + "iteration_tokens_total",
                                          "Tokens computed per engine step.",
                                          buckets=_TOKEN_BUCKETS, registry=r)
        self.request_success = Counter(P + "request_success", "Finished requests by reason.",
                                       labelnames=["finished_reason"], registry=r)

    def on_step(self, stats: dict) -> None:
        """Loop-thread hook after each engine step."""
        n = stats.get("last_step_tokens")
        if n:
            self.iteration_tokens.observe(n)

    def on_finished(self, d: RequestDelta) -> None:
        """Loop-thread hook for each finished (or server-failed / aborted) request."""
        if d.error is not None:  # ended by the server: 500 failure, 499 client gone, 503 shutdown
            self.request_success.labels("error" if d.status == 500 else "abort").inc()
            return
        reason = d.outputs[0].finish_reason if d.outputs else "abort"
        self.request_success.labels(reason or "abort").inc()
        m = d.metrics
        if m is None:
            return
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.queue_time is not None:
            self.queue_time.observe(m.queue_time)
        if m.e2el is not None:
            self.e2e.observe(m.e2el)
        times = list(m.token_times)
        for a, b in zip(times, times[1:]):
            self.itl.observe(b - a)

    def render(self) -> bytes:
        return generate_latest(self.registry)
