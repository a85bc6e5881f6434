"""Seconds from `jaxserve serve` to healthy and to the first streamed token (issue 12).

    .venv/bin/python scripts/measure_startup.py --label after_cold --dir /tmp/st/d32 \
        [--cold] [-- extra serve flags, e.g. --max_num_seqs=16 --warmup=full]

Starts the server on the three caches under --dir (compile cache `cc`, params cache
`pc`, executable cache `ec`; --cold deletes them first, so the run converts the GGUF
and compiles everything), then measures from process start: /health == 200, the
first token of one streamed greedy completion sent right after, and (progressive
warm-up) the moment every program is ready (/health's warmup_done). "Params ready"
is the timestamp of the runner's KV-capacity log line, logged right after the
params are on the device. Prints one JSON line with `uptime` before and after.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import httpx


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--port", type=int, default=8491)
    ap.add_argument("--timeout", type=float, default=1800)
    a, extra = ap.parse_known_args()
    extra = [x for x in extra if x != "--"]
    caches = {k: os.path.join(a.dir, k) for k in ("cc", "pc", "ec")}
    if a.cold:
        for d in caches.values():
            shutil.rmtree(d, ignore_errors=True)
    os.makedirs(a.dir, exist_ok=True)
    log_path = os.path.join(a.dir, f"{a.label}.log")
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", f"--port={a.port}",
           f"--compile_cache_dir={caches['cc']}", f"--params_cache_dir={caches['pc']}",
           f"--executable_cache_dir={caches['ec']}", *extra]
    res: dict = {"label": a.label, "cmd": " ".join(cmd), "uptime_start": uptime()}
    t_wall0 = time.time()
    t0 = time.perf_counter()
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{a.port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
            try:
                r = httpx.get(base + "/health", timeout=2)
                if r.status_code == 200:
                    res["healthy_s"] = time.perf_counter() - t0
                    res["health"] = r.json()
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > a.timeout:
                raise RuntimeError("not healthy in time")
            time.sleep(0.1)
        body = {"model": httpx.get(base + "/v1/models").json()["data"][0]["id"],
                "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
                "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if "first_token_s" not in res and line.startswith("data: ") and '"text"' in line:
                    res["first_token_s"] = time.perf_counter() - t0
        res["first_request_done_s"] = time.perf_counter() - t0
        while not res.get("health", {}).get("warmup_done", True):
            try:
                h = httpx.get(base + "/health", timeout=30).json()
            except httpx.HTTPError:
                continue
            if h.get("warmup_done"):
                res["all_programs_s"] = time.perf_counter() - t0
                res["health"] = h
                break
            if time.perf_counter() - t0 > a.timeout:
                break
            time.sleep(0.5)
        m = httpx.get(base + "/metrics").text
        res["metrics"] = {ln.split()[0]: float(ln.split()[1]) for ln in m.splitlines()
                          if ln.startswith(("jaxserve:num_compiles", "jaxserve:programs",
                                            "jaxserve:warmup"))}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    res["uptime_end"] = uptime()
    res.update(parse_log(log_path, t_wall0))
    if "params_ready_s" in res and "first_token_s" in res:
        res["first_token_after_params_s"] = res["first_token_s"] - res["params_ready_s"]
    print(json.dumps(res))


_ABSL = re.compile(r"^[IWEF](\d{4}) (\d\d:\d\d:\d\d\.\d+) +\d+ [^\]]+\] (.*)$")


def parse_log(log_path: str, t_wall0: float) -> dict:
    """Phase times (seconds after t_wall0) from the absl-formatted server log."""
    out: dict = {}
    year = datetime.date.fromtimestamp(t_wall0).year
    for line in open(log_path, errors="replace"):
        m = _ABSL.match(line.split("\r")[-1].strip()) or _ABSL.search(line)
        if not m:
            continue
        t = datetime.datetime.strptime(f"{year}{m.group(1)} {m.group(2)}",
                                       "%Y%m%d %H:%M:%S.%f").timestamp() - t_wall0
        msg = m.group(3)
        if "KV cache:" in msg and "params_ready_s" not in out:
            out["params_ready_s"] = t
        if msg.startswith(("converted ", "restored ")) and "params_line" not in out:
            out["params_line"] = msg
        if "warm-up:" in msg or "ready with" in msg:
            out.setdefault("warmup_lines", []).append(f"{t:.1f}s {msg}")
    return out


if __name__ == "__main__":
    main()
