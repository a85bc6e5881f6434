"""Issue 24's server report: N streaming clients against `jaxserve serve`'s app over the
fake runner's FIFO device (D ms a step) with SmolLM2's tokenizer detokenizing every token.

    PYTHONPATH=. .venv/bin/python scripts/measure_server_stream.py --clients=64 --device_ms=1

The server (engine thread + asyncio HTTP loop, one process, as `jaxserve serve` runs; with
--engine_process the engine in a child process of its own) is a subprocess; the clients
run in this process (their own GIL), each a streaming /v1/completions request with `ignore_eos` and `continuous_usage_stats`, so every SSE event
says how many tokens the request has. The window starts once every client has had its
first event and ends when the first client finishes. Printed: the client-side tokens per
request per second (goal 1000 / D), SSE events per request per second, and the engine's
step period over the window (its `num_steps` counter from /metrics), and CPU per step
from /proc/<pid>/task/*/stat: the server's main thread (the asyncio HTTP loop: SSE
formatting and writes), its busiest other thread (the engine loop, wherever it runs), the
server process and the engine process in all, and the clients' own process (bare asyncio
sockets, the cheapest client: it shares the machine's cores with the server).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import subprocess
import sys
import time
from typing import Any

import httpx

PORT = 8479


def fake_engine(clients: int, device_ms: float, stream_interval: int) -> Any:
    """The bench-host engine (fake runner, SmolLM2's tokenizer), frozen as after warm-up."""
    from jaxserve.bench.host import _engine
    from jaxserve.checkpoint.loader import load_tokenizer
    from jaxserve.engine.stats import freeze_gc_heap

    engine = _engine(clients, device_ms, False, load_tokenizer(None),
                     stream_interval=stream_interval)
    freeze_gc_heap()  # as `jaxserve serve` does after warm-up
    return engine


def serve(clients: int, device_ms: float, stream_interval: int, engine_process: bool) -> None:
    """The server process: the bench-host engine behind the OpenAI app, on a thread of
    this process or (engine_process) in a child process of its own."""
    from jaxserve.server.api_server import serve as run_server

    factory = functools.partial(fake_engine, clients, device_ms, stream_interval)
    run_server(factory if engine_process else factory(), port=PORT, served_model_name="m",
               log_level="warning", engine_process=engine_process)


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


async def _client(max_tokens: int, log: list) -> None:
    """One streaming client on a bare asyncio socket: the 64 clients share this machine's
    2 cores with the server, and httpx + json per SSE event cost about as much CPU as the
    server's own work per event. Each read logs (time, completion_tokens of its last
    event, the events in it); the token count is read from the usage's bytes."""
    body = json.dumps({
        "model": "m", "prompt": "Tell me a long story about the sea.", "stream": True,
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", PORT)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                 + body)
    key, tail = b'"completion_tokens":', b""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"server answered {head[:40]!r}")
        while True:
            chunk = await reader.read(1 << 16)
            if not chunk:
                return
            buf = tail + chunk  # a pattern split across two reads is found in the second
            at = buf.rfind(key)
            if at >= 0 and buf.find(b",", at) > 0:
                n = int(buf[at + len(key):buf.find(b",", at)])
                log.append((time.perf_counter(), n, chunk.count(b"data: {")))
            if b"data: [DONE]" in buf:
                return
            tail = buf[-64:]
    finally:
        writer.close()


def _server_cpu(pid: int) -> dict[tuple[int, int], float]:
    """CPU seconds of each thread of the server and of its engine process, if any, keyed
    (process, thread)."""
    from jaxserve.bench.servers import child_pids

    return {(p, t): c for p in [pid] + child_pids(pid) for t, c in _thread_cpu(p).items()}


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
        cpu_at["start"] = _server_cpu(pid)
        cpu_at["clients0"] = time.process_time()

    tasks = [asyncio.create_task(_client(max_tokens, logs[i])) for i in range(clients)]
    watcher = asyncio.create_task(watch())
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    steps_at["end"] = (time.perf_counter(), _steps(sync))
    cpu_at["end"] = _server_cpu(pid)
    cpu_at["end"]["clients"] = time.process_time() - cpu_at["clients0"]
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
    ap.add_argument("--engine_process", action="store_true",
                    help="the engine in its own process (jaxserve serve --engine_process)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        serve(a.clients, a.device_ms, a.stream_interval, a.engine_process)
        return 0
    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    cmd = [sys.executable, __file__, "--serve", f"--clients={a.clients}",
           f"--device_ms={a.device_ms}", f"--stream_interval={a.stream_interval}"]
    cmd += ["--engine_process"] if a.engine_process else []
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
        inside = [(t, n, e) for t, n, e in log if t0 <= t <= t1]
        before = [n for t, n, _ in log if t < t0]
        gained.append((inside[-1][1] if inside else 0) - (before[-1] if before else 0))
        events.append(sum(e for _, _, e in inside))
    n = len(logs)
    period = window / max(s1 - s0, 1) * 1e3
    steps = max(s1 - s0, 1)
    clients_ms = c1.pop("clients") / steps * 1e3
    used = {k: c1[k] - c0.get(k, 0.0) for k in c1}
    main_ms = used.pop((proc.pid, proc.pid), 0.0) / steps * 1e3
    engine_ms = max(used.values(), default=0.0) / steps * 1e3
    api_ms = main_ms + sum(c for (p, _), c in used.items() if p == proc.pid) / steps * 1e3
    other_ms = sum(c for (p, _), c in used.items() if p != proc.pid) / steps * 1e3
    print(f"clients={n} D={a.device_ms:g} ms stream_interval={a.stream_interval}: window "
          f"{window:.2f} s, tokens/request/s {sum(gained) / n / window:.1f} (goal "
          f"{1000 / a.device_ms:.0f}), SSE events/request/s {sum(events) / n / window:.1f}, "
          f"engine period {period:.2f} ms ({s1 - s0:.0f} steps); server CPU per step: HTTP loop "
          f"{main_ms:.2f} ms, busiest other thread {engine_ms:.2f} ms, server process "
          f"{api_ms:.2f} ms, engine process {other_ms:.2f} ms; the clients' process "
          f"{clients_ms:.2f} ms; load after "
          f"{os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
