"""Soak traffic generator: N seconds of mixed requests at a jaxserve server, then a report.

    python scripts/soak.py --url=http://127.0.0.1:8000 --seconds=60 --server_pid=1234

Workers (asyncio, httpx) loop until the deadline, each iteration one scenario
drawn at random: completions and chat, streamed and not, n > 1, a stream the
client aborts after a few chunks, a non-streamed request whose client times out
(a disconnect), and a bad request that must get a 400. Every loop is bounded by
the deadline and every request by a timeout, so the run stops by itself.

The report (JSON on stdout, one summary line on stderr) holds requests done per
scenario, errors by class, latency percentiles of the successful requests, the
server's RSS at start (after warm-up) and end, and the KV blocks in use once
the server is idle (read from /metrics: total - free; must be 0). The exit
status is 1 when a check fails: any 5xx, any unexpected status or transport
error, KV blocks in use at the end, or RSS growth above --max_rss_growth.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing".split()
# (body overrides, route) that must be refused with a 400.
BAD = [
    ({"max_tokens": 0}, CMPL), ({"n": 99}, CMPL), ({"top_p": 0}, CMPL),
    ({"temperature": "hot"}, CMPL), ({"stop_token_ids": [10**12]}, CMPL),
    ({"stream_options": {"include_usage": True}}, CHAT), ({"prompt": []}, CMPL),
    ({"logprobs": 10**6}, CMPL), ({"messages": []}, CHAT), ({"seed": -1}, CHAT),
]


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))


def _body(route: str, rng: random.Random, **kw) -> dict:
    common = {"max_tokens": rng.randint(1, 16), "temperature": rng.choice([0.0, 0.8]),
              "seed": rng.randint(0, 2**31)}
    if route == CMPL:
        return {"prompt": _prompt(rng), **common, **kw}
    return {"messages": [{"role": "user", "content": _prompt(rng)}], **common, **kw}


class Stats:
    """Counters shared by the workers (one event loop: no locks needed)."""

    def __init__(self):
        self.done: Counter = Counter()
        self.errors: Counter = Counter()
        self.latency_s: list[float] = []

    def ok(self, scenario: str, t0: float) -> None:
        self.done[scenario] += 1
        self.latency_s.append(time.monotonic() - t0)

    def fail(self, scenario: str, kind: str) -> None:
        self.errors[f"{scenario}:{kind}"] += 1


async def _plain(c: httpx.AsyncClient, st: Stats, rng: random.Random, name: str, route: str,
                 **kw) -> None:
    t0 = time.monotonic()
    r = await c.post(route, json=_body(route, rng, **kw))
    if r.status_code == 200 and len(r.json()["choices"]) == kw.get("n", 1):
        st.ok(name, t0)
    else:
        st.fail(name, f"http_{r.status_code}")


async def _stream(c: httpx.AsyncClient, st: Stats, rng: random.Random, name: str, route: str,
                  abort_after: int | None = None) -> None:
    t0, chunks = time.monotonic(), 0
    async with c.stream("POST", route, json=_body(route, rng, stream=True,
                                                  ignore_eos=abort_after is not None)) as r:
        if r.status_code != 200:
            st.fail(name, f"http_{r.status_code}")
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                st.ok(name, t0)
                return
            if '"error"' in line[:20]:
                st.fail(name, "sse_error")
                return
            chunks += 1
            if abort_after is not None and chunks >= abort_after:
                st.ok(name, t0)  # the client walks away; the server must free the request
                return
    st.fail(name, "stream_without_done")


async def _disconnect(c: httpx.AsyncClient, st: Stats, rng: random.Random) -> None:
    t0 = time.monotonic()
    try:
        await c.post(CMPL, json=_body(CMPL, rng, max_tokens=48, ignore_eos=True),
                     timeout=rng.uniform(0.01, 0.2))
    except httpx.TimeoutException:
        pass  # the point: the client hangs up mid-request
    st.ok("disconnect", t0)


async def _bad(c: httpx.AsyncClient, st: Stats, rng: random.Random) -> None:
    t0 = time.monotonic()
    over, route = rng.choice(BAD)
    body = {**_body(route, rng), **over}
    r = await c.post(route, json=body)
    if r.status_code == 400 and r.json()["error"]["message"]:
        st.ok("bad_request", t0)
    else:
        st.fail("bad_request", f"http_{r.status_code}")


async def _one(c: httpx.AsyncClient, st: Stats, rng: random.Random) -> None:
    x = rng.random()
    if x < 0.2:
        await _plain(c, st, rng, "completion", CMPL)
    elif x < 0.35:
        await _plain(c, st, rng, "chat", CHAT)
    elif x < 0.5:
        await _stream(c, st, rng, "completion_stream", CMPL)
    elif x < 0.6:
        await _stream(c, st, rng, "chat_stream", CHAT)
    elif x < 0.7:
        await _plain(c, st, rng, "n_gt_1", rng.choice([CMPL, CHAT]), n=rng.randint(2, 4))
    elif x < 0.8:
        await _stream(c, st, rng, "abort_stream", rng.choice([CMPL, CHAT]),
                      abort_after=rng.randint(1, 3))
    elif x < 0.9:
        await _disconnect(c, st, rng)
    else:
        await _bad(c, st, rng)


async def _worker(url: str, deadline: float, st: Stats, seed: int) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        while time.monotonic() < deadline:
            try:
                await _one(c, st, rng)
            except httpx.TransportError as e:
                st.fail("transport", type(e).__name__)


def _metrics(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if not s.labels}


def _kv_in_use_when_idle(url: str, timeout_s: float = 20.0) -> tuple[int, dict]:
    """KV blocks in use once running = waiting = 0 (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = _metrics(url)
        idle = m["jaxserve:num_requests_running"] == 0 and m["jaxserve:num_requests_waiting"] == 0
        used = int(m["jaxserve:num_total_blocks"] - m["jaxserve:num_free_blocks"])
        if (idle and used == 0) or time.monotonic() > deadline:
            return used, m
        time.sleep(0.2)


def rss_mib(pid: int | None) -> float | None:
    """Resident set size of `pid` in MiB (Linux /proc), or None."""
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


def run(url: str, seconds: float, concurrency: int, pid: int | None, seed: int) -> dict:
    """Drive the traffic; return the report dict (see the module docstring)."""
    rss0 = rss_mib(pid)
    st = Stats()
    t0 = time.monotonic()

    async def main():
        deadline = time.monotonic() + seconds
        await asyncio.gather(*(_worker(url, deadline, st, seed * 1000 + i)
                               for i in range(concurrency)))

    asyncio.run(main())
    wall = time.monotonic() - t0
    kv_used, m = _kv_in_use_when_idle(url)
    health = httpx.get(url + "/health", timeout=10).status_code
    lat = np.asarray(st.latency_s) if st.latency_s else np.zeros(1)
    rss1 = rss_mib(pid)
    return {
        "seconds": round(wall, 1), "concurrency": concurrency,
        "requests_done": sum(st.done.values()), "done_by_scenario": dict(st.done),
        "errors_by_class": dict(st.errors), "num_5xx": sum(
            v for k, v in st.errors.items() if k.split(":")[-1].startswith("http_5")),
        "latency_p50_s": round(float(np.percentile(lat, 50)), 4),
        "latency_p99_s": round(float(np.percentile(lat, 99)), 4),
        "rss_start_mib": rss0, "rss_end_mib": rss1,
        "kv_blocks_in_use_end": kv_used, "kv_blocks_total": int(m["jaxserve:num_total_blocks"]),
        "engine_step_failures": m.get("jaxserve:engine_step_failures_total", 0.0),
        "health_end": health,
    }


def check(report: dict, max_rss_growth: float | None) -> list[str]:
    """The failed checks of a report (empty when the soak passed)."""
    bad = []
    if report["errors_by_class"]:
        bad.append(f"errors: {report['errors_by_class']}")
    if report["kv_blocks_in_use_end"] != 0:
        bad.append(f"{report['kv_blocks_in_use_end']} KV blocks still in use at the end")
    if report["health_end"] != 200:
        bad.append(f"/health answered {report['health_end']} at the end")
    if report["requests_done"] == 0:
        bad.append("no request completed")
    r0, r1 = report["rss_start_mib"], report["rss_end_mib"]
    if max_rss_growth is not None and r0 and r1 and r1 > r0 * (1 + max_rss_growth):
        bad.append(f"RSS grew {r0:.0f} -> {r1:.0f} MiB (> {max_rss_growth:.0%})")
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--server_pid", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max_rss_growth", type=float, default=None,
                    help="fail when end RSS exceeds start RSS by this fraction (e.g. 0.05)")
    a = ap.parse_args(argv)
    report = run(a.url, a.seconds, a.concurrency, a.server_pid, a.seed)
    failed = check(report, a.max_rss_growth)
    report["failed_checks"] = failed
    print(json.dumps(report, indent=1))
    print(f"soak: {report['requests_done']} requests in {report['seconds']} s, "
          f"p99 {report['latency_p99_s']} s, errors {report['errors_by_class'] or 'none'}, "
          f"KV in use {report['kv_blocks_in_use_end']}, RSS {report['rss_start_mib']} -> "
          f"{report['rss_end_mib']} MiB: {'FAIL ' + '; '.join(failed) if failed else 'ok'}",
          file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
