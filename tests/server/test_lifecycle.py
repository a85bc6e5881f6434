"""Warm-up 503, engine failures contained, shutdown (should_exit and SIGTERM) aborts in flight."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest

from .helpers import (MODEL, fake_engine, fake_only, healthy_probe, metrics_values,
                      running_server, wait_idle)

REPO = Path(__file__).resolve().parents[2]
CMPL = "/v1/completions"


def _body(**kw):
    return {"model": MODEL, "temperature": 0, "max_tokens": 4, "prompt": "hi", **kw}


def test_503_while_warming_up_then_ready():
    release = threading.Event()

    def factory():
        assert release.wait(20)
        return fake_engine()

    with running_server(factory, wait_ready=False) as srv:
        r = httpx.get(srv.url("/health"))
        assert r.status_code == 503 and r.json()["error"]["message"] == "warming up"
        r = httpx.post(srv.url(CMPL), json=_body())
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        release.set()
        deadline = time.monotonic() + 10
        while httpx.get(srv.url("/health")).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        srv.engine = srv.async_engine.engine
        healthy_probe(srv)


def test_failed_engine_construction_reports_503():
    def factory():
        raise RuntimeError("out of device memory (scripted)")

    with running_server(factory, wait_ready=False) as srv:
        deadline = time.monotonic() + 10
        while srv.async_engine.state != "failed":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = httpx.get(srv.url("/health"))
        assert r.status_code == 503 and "out of device memory" in r.json()["error"]["message"]
        assert httpx.post(srv.url(CMPL), json=_body()).status_code == 503


def _served(process: bool, **engine_args):
    """running_server over fake_engine(**engine_args): on the server's thread, or in an
    engine process of its own (engine_process=True, built there from the factory)."""
    factory = functools.partial(fake_engine, **engine_args)
    return running_server(factory if process else factory(), engine_process=process)


# The split is the server's plumbing, whatever runs the steps: its variant runs in the
# fake-engine pass only (the tiny pass would compile the model again in each process).
ENGINE_PROCESS = pytest.mark.parametrize(
    "process", [False, pytest.param(True, marks=fake_only)], ids=["thread", "process"])


@ENGINE_PROCESS
def test_step_exception_fails_in_flight_requests_and_keeps_serving(process):
    with _served(process) as srv:
        base = metrics_values(httpx.get(srv.url("/metrics")).text)["jaxserve:num_free_blocks"]
        r = httpx.post(srv.url(CMPL), json=_body(prompt="STEPFAIL"), timeout=10)
        assert r.status_code == 500 and "scripted step failure" in r.json()["error"]["message"]
        r = httpx.post(srv.url(CMPL), json=_body(prompt="STEPFAIL", stream=True), timeout=10)
        events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert "scripted step failure" in json.loads(events[-2])["error"]["message"]
        m = wait_idle(srv, base)
        # Each request's step fails, is retried once (issue 13), fails again: 2 x 2.
        assert m["jaxserve:engine_step_failures_total"] == 4
        assert m["jaxserve:request_success_total{finished_reason=error}"] == 2
        healthy_probe(srv)


@ENGINE_PROCESS
def test_request_error_is_contained_to_that_request(process):
    with _served(process) as srv:
        async def main():
            async with httpx.AsyncClient(timeout=10) as c:
                bad = c.post(srv.url(CMPL), json=_body(prompt="REQFAIL"))
                good = c.post(srv.url(CMPL), json=_body(max_tokens=20, ignore_eos=True))
                return await asyncio.gather(bad, good)

        bad, good = asyncio.run(main())
        assert bad.status_code == 500 and "scripted request failure" in bad.text
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 20
        healthy_probe(srv)


@ENGINE_PROCESS
def test_shutdown_aborts_in_flight_streams_quickly(process):
    with _served(process, max_model_len=1024, step_delay=0.005) as srv:
        lines: list[str] = []

        def consume():
            body = _body(max_tokens=1000, ignore_eos=True, stream=True)
            with httpx.stream("POST", srv.url(CMPL), json=body, timeout=30) as r:
                for ln in r.iter_lines():
                    lines.append(ln)

        t = threading.Thread(target=consume)
        t.start()
        while len(lines) < 3:
            time.sleep(0.01)
        t0 = time.monotonic()
        srv.stop()  # should_exit, as a signal handler would set it
        t.join(10)
        assert time.monotonic() - t0 < 5 and not t.is_alive()
        data = [ln[6:] for ln in lines if ln.startswith("data: ")]
        assert data[-1] == "[DONE]"
        assert "shutting down" in json.loads(data[-2])["error"]["message"]
        assert srv.async_engine.state == "stopped"
        if process:  # the engine process flushed its last stats, then exited
            assert srv.async_engine.stats["num_running"] == 0
            assert srv.async_engine._proc.poll() == 0
        else:
            assert not srv.async_engine.engine.has_unfinished_requests()


_SERVE_SCRIPT = textwrap.dedent("""
    import sys
    sys.path[:0] = [{tests!r}, {server_tests!r}]
    from helpers import fake_engine
    from jaxserve.server import serve
    serve(lambda: fake_engine(max_model_len=1024, step_delay=0.005),
          host="127.0.0.1", port={port}, served_model_name="fake-model", log_level="warning")
    print("SERVE_RETURNED", flush=True)
""")


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigterm_aborts_in_flight_and_exits_cleanly():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = _SERVE_SCRIPT.format(tests=str(Path(__file__).parents[1]),
                                  server_tests=str(Path(__file__).parent), port=port)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.1)
        data: list[str] = []
        body = _body(max_tokens=1000, ignore_eos=True, stream=True)
        with httpx.stream("POST", base + CMPL, json=body, timeout=30) as r:
            for ln in r.iter_lines():
                if ln.startswith("data: "):
                    data.append(ln[6:])
                if len(data) == 3:
                    os.kill(proc.pid, signal.SIGTERM)
        assert data[-1] == "[DONE]"
        assert "shutting down" in json.loads(data[-2])["error"]["message"]
        rc = proc.wait(15)
        out = proc.stdout.read()
        assert rc == 0, out
        assert "SERVE_RETURNED" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
