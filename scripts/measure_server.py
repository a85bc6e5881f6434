"""Server start-up time (cold and with the compile cache), then load through `bench serve`.

    .venv/bin/python scripts/measure_server.py [--trace ../shared/bench/ragged64.jsonl]

Starts `jaxserve serve` twice on a fresh compile-cache directory (the first
start compiles every bucket program, the second reads them back), timing
process start -> GET /health == 200. The second server then takes one
request alone and the trace with its arrival times, through the same load
generator any OpenAI-compatible server would get (`jaxserve bench serve`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx

PORT = 8477


def start(cache_dir: str, extra: list[str]) -> tuple[subprocess.Popen, float]:
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", f"--port={PORT}",
           f"--compile_cache_dir={cache_dir}", *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{PORT}/health", timeout=1).status_code == 200:
                return proc, time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.25)


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)


def bench(trace: str, out: str, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "jaxserve.cli", "bench", "serve",
           f"--base_url=http://127.0.0.1:{PORT}/v1", f"--trace={trace}", f"--output_json={out}",
           *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default="../shared/bench/ragged64.jsonl")
    ap.add_argument("--max_num_seqs", type=int, default=16)
    a = ap.parse_args()
    extra = [f"--max_num_seqs={a.max_num_seqs}"]
    tmp = tempfile.mkdtemp()
    cache = os.path.join(tmp, "cc")
    proc, cold = start(cache, extra)
    stop(proc)
    proc, warm = start(cache, extra)
    print(f"start-up to /health 200: cold {cold:.1f} s, with compile cache {warm:.1f} s")
    try:
        one = os.path.join(tmp, "one.jsonl")
        with open(a.trace) as f:
            first = json.loads(f.readline())
        with open(one, "w") as f:
            f.write(json.dumps(dict(first, max_tokens=64, arrival_s=0.0)) + "\n")
        for name, trace, args in (("single request", one, []),
                                  ("trace with arrivals", a.trace, [])):
            r = bench(trace, os.path.join(tmp, "r.json"), args)["summary"]
            print(f"{name}: {r['completed']}/{r['num_requests']} completed, "
                  f"{r['output_throughput']:.1f} output tok/s, TTFT median "
                  f"{r['ttft_ms']['median']:.0f} ms p99 {r['ttft_ms']['p99']:.0f} ms, TPOT median "
                  f"{r['tpot_ms']['median']:.1f} ms p99 {r['tpot_ms']['p99']:.1f} ms")
    finally:
        stop(proc)


if __name__ == "__main__":
    main()
