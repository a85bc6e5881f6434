"""Servers for `jaxserve bench compare`: build llama.cpp, start and stop any server by PID.

llama.cpp's `llama-server` and `llama-quantize` are built once, and the GGUF
requantized to F32 once.

The source is the llama.cpp tree vendored in the `llama-cpp-python` sdist on
PyPI (`pip download --no-deps --no-binary :all:`), built with CMake Release
and `GGML_NATIVE` and without curl, OpenSSL, the web UI and the tests: the
recipe of `../shared/bench/BASELINES.md` (without the three UI/tests flags
the build tries to download its web UI).

A server is started with PR_SET_PDEATHSIG (it dies with this process even on
SIGKILL), waited on until GET /health is 200, and stopped by its PID.
"""

from __future__ import annotations

import ctypes
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Sequence

import httpx

# The version BASELINES.md measured; its vendor/llama.cpp is the tree we build.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
               "-DLLAMA_BUILD_TESTS=OFF")


def require_tool(name: str, hint: str) -> str:
    """The path of `name` on PATH. Raises RuntimeError with the install hint when it is missing."""
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"`{name}` not found on PATH; {hint}")
    return path


def _run_logged(cmd: Sequence[str], log, cwd: Path | None = None) -> None:
    log.write(f"$ {shlex.join(map(str, cmd))}\n")
    log.flush()
    r = subprocess.run(list(map(str, cmd)), cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
    if r.returncode:
        raise RuntimeError(f"{shlex.join(map(str, cmd))} failed with {r.returncode}; see {log.name}")


def ensure_llama_build(cache: Path, version: str, jobs: int) -> dict[str, Path]:
    """Build llama-server and llama-quantize into `cache/build-VERSION/bin` unless they exist.

    Raises:
      RuntimeError: cmake missing, the download or the build failed (names the log).
    """
    bins = {t: cache / f"build-{version}" / "bin" / t for t in ("llama-server", "llama-quantize")}
    if all(p.is_file() for p in bins.values()):
        return bins
    require_tool("cmake", "install it: `apt-get update && apt-get install -y cmake` or `pip install cmake`")
    require_tool("c++", "a C++ compiler is needed (apt-get install -y build-essential)")
    cache.mkdir(parents=True, exist_ok=True)
    tree = cache / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    log_path = cache / f"build-{version}.log"
    print(f"building llama.cpp from llama-cpp-python=={version} (about 8 min at -j2); log: {log_path}",
          flush=True)
    with open(log_path, "a") as log:
        if not (tree / "CMakeLists.txt").is_file():
            sdist = cache / "src" / f"llama_cpp_python-{version}.tar.gz"
            if not sdist.is_file():
                _run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                             ":all:", f"llama-cpp-python=={version}", "-d", cache / "src"], log)
            with tarfile.open(sdist) as tf:
                tf.extractall(cache, filter="data")
        build = cache / f"build-{version}"
        _run_logged(["cmake", "-S", tree, "-B", build, *CMAKE_FLAGS], log)
        _run_logged(["cmake", "--build", build, f"-j{jobs}", "--target", *bins], log)
    return bins


def ensure_f32_gguf(quantize: Path, src: Path, cache: Path) -> Path:
    """`src` requantized to F32 in `cache/models/` (once; written to a temp name, then renamed)."""
    # The whole stem plus the size: two quantizations (or two sizes) of one model never share.
    dst = cache / "models" / f"{src.stem}-{src.stat().st_size}.F32.gguf"
    if dst.is_file():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".tmp")
    r = subprocess.run([str(quantize), "--allow-requantize", str(src), str(tmp), "F32"],
                       capture_output=True, text=True)
    if r.returncode:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama-quantize failed ({r.returncode}): {r.stderr[-1000:]}")
    tmp.rename(dst)
    return dst


# ------------------------------------------------------------ processes
def parse_proc_status(text: str) -> dict[str, float]:
    """VmHWM (peak RSS) and VmRSS in MiB from /proc/PID/status text (the kernel prints kB)."""
    out = {}
    for line in text.splitlines():
        key, _, val = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            out[key] = int(val.split()[0]) / 1024
    return out


def child_pids(pid: int) -> list[int]:
    """The pids of process `pid`'s children (/proc/PID/task/PID/children; [] once it is
    gone)."""
    try:
        return [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def tree_proc_status(pid: int) -> dict[str, float]:
    """`parse_proc_status` summed over process `pid` and its descendants (a server whose
    engine runs in a child process, `jaxserve serve --engine_process`). The summed
    VmHWM is an upper bound of the tree's peak (the peaks may fall at different times)."""
    out: dict[str, float] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            st = parse_proc_status(Path(f"/proc/{p}/status").read_text())
        except OSError:  # exited meanwhile
            continue
        for k, v in st.items():
            out[k] = out.get(k, 0.0) + v
        todo += child_pids(p)
    return out


def uptime() -> str:
    """`uptime`'s line: wall time and the 1/5/15-minute load averages."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


_LIVE: list[subprocess.Popen] = []


def _die_with_parent() -> None:
    """preexec_fn: PR_SET_PDEATHSIG, so the server gets SIGTERM if this process dies."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def live_servers() -> list[subprocess.Popen]:
    """The servers started by `start_server` and not yet stopped (a copy)."""
    return list(_LIVE)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cmd: Sequence[str], port: int, log_path: Path, timeout_s: float,
                 cwd: Path | None = None) -> subprocess.Popen:
    """Start `cmd` (stdout+stderr to log_path) and wait for GET /health == 200.

    Raises:
      RuntimeError: the process exited, or /health was not 200 within timeout_s
        (the process is stopped first; the message holds the log's tail).
    """
    log = open(log_path, "w")
    proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                            preexec_fn=_die_with_parent)
    log.close()
    _LIVE.append(proc)
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2) as client:  # one client: a new one per poll costs CPU we measure
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if client.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    return proc
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
    stop_server(proc)
    tail = log_path.read_text(errors="replace")[-1500:]
    raise RuntimeError(f"server {shlex.join(cmd)} not healthy (exit {proc.returncode}, "
                       f"timeout {timeout_s} s); log tail:\n{tail}")


def stop_server(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM by PID, SIGKILL after `grace_s`; forget it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc in _LIVE:
        _LIVE.remove(proc)


def exit_on_signal(signum, _frame) -> None:
    """A signal handler: turn SIGTERM/SIGHUP into SystemExit so `finally` blocks stop the servers."""
    raise SystemExit(128 + signum)  # unwinds through the `finally` that stops the servers
