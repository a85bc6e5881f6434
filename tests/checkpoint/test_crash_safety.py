"""Crash safety: kill -9 the server mid-load and at each fault point; the next start is clean.

Each case runs `jaxserve serve` on the tiny GGUF fixture (tests/fixtures/tiny_gguf,
not SmolLM2: seconds, not minutes) as a subprocess on 127.0.0.1 with its own
params cache and JAX compilation cache, kills it (SIGKILL from outside, or the
process SIGKILLs itself at a `jaxserve.testing.faults` point), restarts it on the same
cache directories and checks that it is healthy and answers the same greedy
tokens as an undisturbed server. Damaged caches (truncated and garbage files)
must be rebuilt, never crash the start.

The oracle is an undisturbed server of the same configuration (module fixture
`reference`), whose greedy answers do not depend on any cache.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "tests/fixtures/tiny_gguf/tiny-f32.gguf"
# One token bucket and one seq bucket: one program to compile per cold start.
SERVE_ARGS = ["--max_model_len=64", "--num_kv_blocks=64", "--block_size=4", "--max_num_seqs=4",
              "--max_num_batched_tokens=32", "--token_buckets=32", "--seq_buckets=4",
              "--nounroll_layers", "--attention_backend=xla"]
PROMPTS = ["hello world", "the quick brown fox"]
START_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `jaxserve serve` subprocess with the given cache dirs (and fault, if any)."""

    def __init__(self, caches: Path, fault: str | None = None, extra: tuple[str, ...] = (),
                 new_session: bool = False):
        self.port = _free_port()
        env = {k: v for k, v in os.environ.items() if k != "JAXSERVE_FAULT"}
        if fault:
            env["JAXSERVE_FAULT"] = fault
        env["JAX_PLATFORMS"] = "cpu"
        self.log = open(caches / f"server-{self.port}.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jaxserve.cli", "serve", f"--model={MODEL}",
             f"--port={self.port}", f"--params_cache_dir={caches / 'params'}",
             f"--compile_cache_dir={caches / 'compile'}",
             f"--executable_cache_dir={caches / 'executable'}", *SERVE_ARGS, *extra],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=new_session)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            assert rc is None, f"server exited with {rc}: {self.tail()}"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        pytest.fail(f"server not healthy after {START_TIMEOUT_S} s: {self.tail()}")

    def greedy(self) -> list[tuple[str, int]]:
        out = []
        for p in PROMPTS:
            r = httpx.post(self.url + "/v1/completions", timeout=60, json={
                "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            out.append((r.json()["choices"][0]["text"], r.json()["usage"]["completion_tokens"]))
        return out

    def wait_exit(self, timeout: float = START_TIMEOUT_S) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.wait_exit(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.wait_exit(30)

    def tail(self) -> str:
        if not self.log.closed:
            self.log.flush()
        text = Path(self.log.name).read_text(errors="replace")
        return text[-3000:]


def _serve_and_answer(caches: Path) -> list[tuple[str, int]]:
    srv = Server(caches)
    try:
        srv.wait_healthy()
        return srv.greedy()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[list, Path]:
    """Greedy answers of an undisturbed server, and its (now warm) cache dirs."""
    caches = tmp_path_factory.mktemp("reference")
    return _serve_and_answer(caches), caches


def _no_stale_tmp(caches: Path) -> None:
    left = [p.name for p in (caches / "params").glob("*.tmp*")]
    assert not left, f"temporary params-cache entries left behind: {left}"


def _traffic(url: str, stop: threading.Event) -> None:
    """Streamed requests until the server dies (transport errors are the point)."""
    while not stop.is_set():
        try:
            with httpx.stream("POST", url + "/v1/completions", timeout=30, json={
                    "prompt": "load", "max_tokens": 40, "stream": True, "ignore_eos": True}) as r:
                for _ in r.iter_lines():
                    pass
        except httpx.HTTPError:
            time.sleep(0.01)


@pytest.mark.parametrize("phase", ["params_cache", "compile", "traffic"])
def test_kill_9_mid_load_then_clean_restart(reference, tmp_path, phase):
    """SIGKILL from outside while the params cache is written, while warm-up compiles, or
    while 6 clients stream (warm caches)."""
    want, warm = reference
    if phase == "traffic":
        shutil.copytree(warm / "params", tmp_path / "params")
        shutil.copytree(warm / "compile", tmp_path / "compile")
    # The tiny model's params save takes ~1 ms: a pause after its leaves are written keeps
    # the temporary entry on disk long enough for this kill from outside to land in it.
    srv = Server(tmp_path, fault="params_cache_pause" if phase == "params_cache" else None)
    deadline = time.monotonic() + START_TIMEOUT_S
    if phase == "traffic":
        srv.wait_healthy()
        stop = threading.Event()
        clients = [threading.Thread(target=_traffic, args=(srv.url, stop)) for _ in range(6)]
        for c in clients:
            c.start()
        time.sleep(1.0)
    while phase != "traffic" and not (any((tmp_path / "params").glob("*.tmp*"))
                                      if phase == "params_cache" else "warm-up" in srv.tail()):
        assert srv.proc.poll() is None and time.monotonic() < deadline, srv.tail()
        time.sleep(0.005)
    srv.kill()
    if phase == "traffic":
        stop.set()
        for c in clients:
            c.join(30)
    assert srv.proc.returncode == -signal.SIGKILL
    assert _serve_and_answer(tmp_path) == want
    _no_stale_tmp(tmp_path)


@pytest.mark.parametrize("fault", ["params_cache_write", "params_cache_rename",
                                   "compile_cache_write"])
def test_fault_point_kill_then_clean_restart(reference, tmp_path, fault):
    want, warm = reference
    if fault != "compile_cache_write":  # a warm compile cache: only the params write is cold
        shutil.copytree(warm / "compile", tmp_path / "compile")
    srv = Server(tmp_path, fault=fault)
    rc = srv.wait_exit()
    assert rc == -signal.SIGKILL, f"expected death at {fault}, rc={rc}: {srv.tail()}"
    if fault == "compile_cache_write":
        cache_files = list((tmp_path / "compile").glob("*-cache"))
        assert cache_files, "the fault fired before any compile-cache file was written"
    assert _serve_and_answer(tmp_path) == want
    _no_stale_tmp(tmp_path)


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2] if how == "truncate" else os.urandom(max(len(data), 64)))


def test_damaged_caches_are_rebuilt(reference, tmp_path):
    """Every cache file truncated to half or overwritten with random bytes (alternately)."""
    want, warm = reference
    shutil.copytree(warm / "params", tmp_path / "params")
    shutil.copytree(warm / "compile", tmp_path / "compile")
    damaged = sorted((tmp_path / "compile").glob("*-cache"))
    damaged += sorted(p for p in (tmp_path / "params").rglob("*") if p.is_file())
    assert len(damaged) > 2
    for i, p in enumerate(damaged):
        _damage(p, "truncate" if i % 2 else "garbage")
    assert _serve_and_answer(tmp_path) == want
    # The entry was rebuilt: a further start restores it without converting.
    assert _serve_and_answer(tmp_path) == want


def _engine_children(pid: int) -> list[int]:
    """The engine process(es) of server `pid`."""
    from jaxserve.bench.servers import child_pids

    out = []
    for k in child_pids(pid):
        try:
            cmd = Path(f"/proc/{k}/cmdline").read_bytes()
        except OSError:
            continue
        if b"jaxserve.server.engine_main" in cmd:
            out.append(int(k))
    return out


def _gone(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":  # exited, not yet reaped by its (dead) parent's reaper
            return True
        time.sleep(0.05)
    return False


def test_engine_process_answers_the_same_and_never_outlives_its_server(reference, tmp_path):
    """`serve --engine_process`: the same greedy answers; SIGTERM to the server or to its
    whole process group (systemd's stop) stops both processes cleanly, and after a SIGKILL
    of the server its engine process exits by itself."""
    want, warm = reference
    for d in ("params", "compile", "executable"):
        shutil.copytree(warm / d, tmp_path / d)
    for how in ("sigterm", "sigterm-group", "sigkill"):
        srv = Server(tmp_path, extra=("--engine_process",), new_session=True)
        try:
            srv.wait_healthy()
            engines = _engine_children(srv.proc.pid)
            assert len(engines) == 1, srv.tail()
            assert srv.greedy() == want
        finally:
            if how == "sigterm-group":
                os.killpg(srv.proc.pid, signal.SIGTERM)
            srv.stop() if how != "sigkill" else srv.kill()
        assert srv.proc.returncode == (-signal.SIGKILL if how == "sigkill" else 0), srv.tail()
        assert "exited unexpectedly" not in srv.tail(), srv.tail()
        assert _gone(engines[0]), f"engine process {engines[0]} outlived the server ({how})"
