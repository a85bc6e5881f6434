"""Seconds from process start to "params ready" for `jaxserve serve|generate` (issue 12).

    .venv/bin/python scripts/measure_params_ready.py --dir /tmp/pr [--cold] [--cmd serve]
        [--repeat 3] [--importtime] [-- extra CLI flags]

Starts the CLI on a params cache `DIR/pc` (--cold deletes it first, so the run
converts the GGUF), JAX compile cache `DIR/cc` and executable cache `DIR/ec`,
timestamps every output line as it arrives, and kills the process at the
runner's "KV cache:" log line, which the runner logs right after the params are
on the device ("params ready"; what comes after it, the warm-up, is not this
script's business). Prints one JSON line per run: params_ready_s, the child's RSS
then (`rss_mib`: VmRSS, VmHWM = peak, RssAnon, RssFile), the
converted/restored line, the seconds of the first line of each phase, the
`uptime` before and after, and the command. With --importtime the child runs
under `python -X importtime` and the 15 slowest top-level imports are listed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _rss(pid: int) -> dict:
    """VmRSS / VmHWM / RssAnon / RssFile of `pid` in MiB (at params ready: the KV cache is
    allocated, no program is loaded yet)."""
    out = {}
    for ln in open(f"/proc/{pid}/status"):
        k = ln.split(":")[0]
        if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[k] = int(ln.split()[1]) // 1024
    return out


def run_once(a: argparse.Namespace, extra: list[str]) -> dict:
    caches = {k: os.path.join(a.dir, k) for k in ("cc", "pc", "ec")}
    if a.cold:
        shutil.rmtree(caches["pc"], ignore_errors=True)
    os.makedirs(a.dir, exist_ok=True)
    py = [sys.executable, *(["-X", "importtime"] if a.importtime else [])]
    cmd = [*py, "-m", "jaxserve.cli", a.cmd, f"--compile_cache_dir={caches['cc']}",
           f"--params_cache_dir={caches['pc']}", f"--executable_cache_dir={caches['ec']}"]
    if a.cmd == "serve":
        cmd.append(f"--port={a.port}")
    else:
        cmd += ["--prompt=hi", "--max_tokens=1", "--print_outputs=false"]
    cmd += extra
    res: dict = {"cmd": " ".join(cmd[1:]), "uptime_start": uptime()}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace")
    lines: list[tuple[float, str]] = []
    imports: list[tuple[int, str]] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            t = time.perf_counter() - t0
            if line.startswith("import time:"):
                parts = line.split("|")
                if len(parts) == 3 and parts[1].strip().isdigit() and not parts[2].startswith("  "):
                    imports.append((int(parts[1]), parts[2].strip()))
                continue
            lines.append((t, line.rstrip()))
            if "restored " in line or "converted " in line:
                res["params_line"] = line.split("] ", 1)[-1].strip()
                res["params_line_s"] = round(t, 3)
            if "KV cache:" in line:
                res["params_ready_s"] = round(t, 3)
                res["rss_mib"] = _rss(proc.pid)
                break
            if t > a.timeout:
                break
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    res["uptime_end"] = uptime()
    if "params_ready_s" not in res:
        res["tail"] = [x for _, x in lines[-15:]]
    res["first_line_s"] = round(lines[0][0], 3) if lines else None
    if imports:
        res["top_imports_ms"] = [(n, us // 1000) for us, n in sorted(imports, reverse=True)[:15]]
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--cmd", default="serve", choices=["serve", "generate"])
    ap.add_argument("--port", type=int, default=8493)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--importtime", action="store_true")
    a, extra = ap.parse_known_args()
    extra = [x for x in extra if x != "--"]
    for _ in range(a.repeat):
        print(json.dumps(run_once(a, extra)), flush=True)


if __name__ == "__main__":
    main()
