"""Issue 24's server report: N streaming clients against `jaxserve serve`'s app over the
fake runner's FIFO device (D ms a step) with SmolLM2's tokenizer detokenizing every token.

    PYTHONPATH=. .venv/bin/python scripts/measure_server_stream.py --clients=64 --device_ms=1

The server (engine thread + asyncio HTTP loop, one process, as `jaxserve serve` runs) is a
subprocess; the clients run in this process (their own GIL), each a streaming
/v1/completions request with `ignore_eos` and `continuous_usage_stats`, so every SSE event
says how many tokens the request has. The window starts once every client has had its
first event and ends when the first client finishes. Printed: the client-side tokens per
request per second (goal 1000 / D), SSE events per request per second, and the engine's
step period over the window (its `num_steps` counter from /metrics), and the server's CPU
per step split between its main thread (the asyncio HTTP loop: SSE formatting and writes)
and its busiest other thread (the engine loop), from /proc/<pid>/task/*/stat.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import httpx

PORT = 8479


def serve(clients: int, device_ms: float, stream_interval: int) -> None:
    """The server process: the bench-host engine (fake runner) behind the OpenAI app."""
    from jaxserve.bench.host import _engine
    from jaxserve.checkpoint.loader import load_tokenizer
    from jaxserve.engine.stats import freeze_gc_heap
    from jaxserve.server.api_server import serve as run_server

    engine = _engine(clients, device_ms, False, load_tokenizer(None),
                     stream_interval=stream_interval)
    freeze_gc_heap()  # as `jaxserve serve` does after warm-up
    run_server(engine, port=PORT, served_model_name="m", log_level="warning")


def _thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of process `pid`."""
    out, tick = {}, os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _steps(client: httpx.Client) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(client.get(f"http://127.0.0.1:{PORT}/metrics").text):
        for s in fam.samples:
            if s.name.endswith("num_steps_total") or s.name.endswith("num_steps"):
                return s.value
    raise RuntimeError("no num_steps counter in /metrics")


async def _client(http: httpx.AsyncClient, max_tokens: int, log: list) -> None:
    body = {"model": "m", "prompt": "Tell me a long story about the sea.", "stream": True,
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    async with http.stream("POST", f"http://127.0.0.1:{PORT}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            usage = json.loads(line[6:]).get("usage")
            if usage:
                log.append((time.perf_counter(), usage["completion_tokens"]))


async def _run(clients: int, max_tokens: int, pid: int) -> tuple[list[list], float, float,
                                                                  float, float, dict, dict]:
    logs: list[list] = [[] for _ in range(clients)]
    steps_at: dict[str, tuple[float, float]] = {}
    cpu_at: dict[str, dict] = {}
    sync = httpx.Client()

    async def watch() -> None:  # the engine's step counter at the window's two ends
        while not all(logs):
            await asyncio.sleep(0.005)
        steps_at["start"] = (time.perf_counter(), await asyncio.to_thread(_steps, sync))
        cpu_at["start"] = _thread_cpu(pid)

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        tasks = [asyncio.create_task(_client(http, max_tokens, logs[i])) for i in range(clients)]
        watcher = asyncio.create_task(watch())
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        steps_at["end"] = (time.perf_counter(), _steps(sync))
        cpu_at["end"] = _thread_cpu(pid)
        await watcher
        await asyncio.gather(*tasks)
    (t0, s0), (t1, s1) = steps_at["start"], steps_at["end"]
    return logs, t0, t1, s0, s1, cpu_at["start"], cpu_at["end"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--device_ms", type=float, default=1.0)
    ap.add_argument("--max_tokens", type=int, default=600)
    ap.add_argument("--stream_interval", type=int, default=1)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        serve(a.clients, a.device_ms, a.stream_interval)
        return 0
    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    cmd = [sys.executable, __file__, "--serve", f"--clients={a.clients}",
           f"--device_ms={a.device_ms}", f"--stream_interval={a.stream_interval}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{PORT}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.2)
        logs, t0, t1, s0, s1, c0, c1 = asyncio.run(_run(a.clients, a.max_tokens, proc.pid))
    finally:
        proc.terminate()
        proc.wait(30)
    window = t1 - t0
    gained, events = [], []
    for log in logs:  # tokens and events inside [t0, t1]
        inside = [(t, n) for t, n in log if t0 <= t <= t1]
        before = [n for t, n in log if t < t0]
        gained.append((inside[-1][1] if inside else 0) - (before[-1] if before else 0))
        events.append(len(inside))
    n = len(logs)
    period = window / max(s1 - s0, 1) * 1e3
    steps = max(s1 - s0, 1)
    used = {tid: c1[tid] - c0.get(tid, 0.0) for tid in c1}
    main_ms = used.pop(proc.pid, 0.0) / steps * 1e3
    engine_ms = max(used.values(), default=0.0) / steps * 1e3
    print(f"clients={n} D={a.device_ms:g} ms stream_interval={a.stream_interval}: window "
          f"{window:.2f} s, tokens/request/s {sum(gained) / n / window:.1f} (goal "
          f"{1000 / a.device_ms:.0f}), SSE events/request/s {sum(events) / n / window:.1f}, "
          f"engine period {period:.2f} ms ({s1 - s0:.0f} steps); server CPU per step: HTTP loop "
          f"{main_ms:.2f} ms, engine thread {engine_ms:.2f} ms; load after "
          f"{os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
