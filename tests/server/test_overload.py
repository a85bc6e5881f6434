"""Overload: a bounded waiting queue (`max_queued_requests`); past it, 503 with Retry-After.

One running slot (max_num_seqs=1) and a queue of 2: the 4th concurrent request
is refused at once (never queued, never a timeout), leaks nothing, and the
server serves normally once the queue drains.
"""

from __future__ import annotations

import contextlib

import httpx
import pytest

from jaxserve.server.async_engine import AsyncEngine

from .helpers import MODEL, fake_engine, fake_only, healthy_probe, running_server, wait_idle

CMPL = "/v1/completions"


def _long(**kw):
    return {"model": MODEL, "prompt": "abc", "max_tokens": 60, "temperature": 0,
            "ignore_eos": True, **kw}


@fake_only
@pytest.mark.parametrize("route", [CMPL, "/v1/chat/completions"])
def test_full_queue_answers_503_with_retry_after(route):
    eng = fake_engine(max_num_seqs=1, step_delay=0.05)  # 60 tokens ~ 3 s of running
    with running_server(eng, max_queued_requests=2) as srv, httpx.Client(timeout=30) as c:
        baseline = eng.get_stats()["num_free_blocks"]
        with contextlib.ExitStack() as stack:
            a = stack.enter_context(c.stream("POST", srv.url(CMPL), json=_long(stream=True)))
            assert a.status_code == 200
            lines = a.iter_lines()  # keep a reference: a collected iterator closes the stream
            next(lines)  # A is running: it produced its first chunk
            for _ in range(2):  # B and C fill the queue
                r = stack.enter_context(c.stream("POST", srv.url(CMPL), json=_long(stream=True)))
                assert r.status_code == 200
            body = (_long() if route == CMPL else
                    {"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
            d = c.post(srv.url(route), json=body)
            assert d.status_code == 503, d.text
            assert d.headers["retry-after"] == "1"
            err = d.json()["error"]
            assert err["type"] == "service_unavailable"
            assert "2 requests waiting" in err["message"]
            assert "max_queued_requests=2" in err["message"]
            assert srv.async_engine.engine.get_stats()["num_waiting"] == 2  # D was never queued
        # Closing the streams aborts A, B, C; then the server is idle and serves again.
        m = wait_idle(srv, baseline)
        assert m["jaxserve:num_free_blocks"] == baseline
        healthy_probe(srv)


@fake_only
def test_group_larger_than_the_queue_is_refused_whole():
    eng = fake_engine(max_num_seqs=1, step_delay=0.0)
    with running_server(eng, max_queued_requests=3) as srv:
        r = httpx.post(srv.url(CMPL), json={**_long(max_tokens=2), "prompt": ["a", "b", "c", "d"]})
        assert r.status_code == 503 and "4 new exceeds max_queued_requests=3" in r.text
        r = httpx.post(srv.url(CMPL), json={**_long(max_tokens=2), "prompt": ["a", "b", "c"]})
        assert r.status_code == 200 and len(r.json()["choices"]) == 3
        healthy_probe(srv)


@pytest.mark.parametrize("bad", [-1, 0])
def test_max_queued_requests_must_be_positive(bad):
    with pytest.raises(ValueError, match=f"max_queued_requests={bad} must be >= 1"):
        AsyncEngine(lambda: None, max_queued_requests=bad)
