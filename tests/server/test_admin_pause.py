"""POST /admin/pause, /admin/resume, /admin/sleep, /admin/wake_up and /health's report (issue 28).

The engine is the FakeRunner one (counting tokens, 20 ms a step, so a request of 40
tokens is in flight for ~0.8 s). References are the same request sent while nothing
is paused: a kept or retracted request must give exactly those tokens (the fake has
no weights, so no mode changes what a token is), an aborted one fails naming the
pause.
"""

from __future__ import annotations

import functools
import threading
import time

import httpx
import pytest

from .helpers import MODEL, fake_only, make_engine, running_server

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY = {"model": MODEL, "prompt": "abc", "max_tokens": 40, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module", params=["thread", pytest.param("process", marks=fake_only)])
def srv(request):
    """The routes with the engine on the server's thread, then in its own process
    (`engine_process=True`: each admin call is a closure sent to it)."""
    factory = functools.partial(make_engine, step_delay=0.02)
    process = request.param == "process"
    with running_server(factory if process else factory(), api_key=KEY,
                        engine_process=process) as s:
        yield s


def post(srv, path, json=None, headers=AUTH):
    return httpx.post(srv.url(path), json=json, headers=headers, timeout=30)


def health(srv) -> dict:
    r = httpx.get(srv.url("/health"))
    assert r.status_code == 200, r.text
    return r.json()


def stats(srv) -> dict:
    return srv.async_engine.stats


def complete_in_thread(srv, box: dict, key: str) -> threading.Thread:
    th = threading.Thread(target=lambda: box.setdefault(key, post(srv, "/v1/completions", BODY,
                                                                   AUTH)))
    th.start()
    return th


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def in_flight(srv, box, key="r") -> threading.Thread:
    """Start BODY in a thread; return once it has some tokens and is still running."""
    before = stats(srv)["generation_tokens_total"]
    th = complete_in_thread(srv, box, key)
    wait_for(lambda: stats(srv)["generation_tokens_total"] >= before + 3)
    assert stats(srv)["num_running"] == 1
    return th


@pytest.fixture(scope="module")
def reference(srv) -> dict:
    r = post(srv, "/v1/completions", BODY)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_routes_need_the_api_key():
    with running_server(make_engine()) as s:  # no key: no admin routes
        assert post(s, "/admin/pause", {"mode": "keep"}).status_code == 404
        assert post(s, "/admin/resume").status_code == 404
    with running_server(make_engine(), api_key=KEY) as s:
        assert post(s, "/admin/pause", {"mode": "keep"}, headers={}).status_code == 401
        assert health(s)["paused"] is False


@fake_only
@pytest.mark.parametrize("mode", ["keep", "retract"])
def test_paused_requests_wait_and_finish_unchanged(srv, reference, mode):
    box: dict = {}
    th = in_flight(srv, box)
    preempted = stats(srv)["num_preemptions"]
    r = post(srv, "/admin/pause", {"mode": mode})
    assert r.status_code == 200, r.text
    assert r.json()["mode"] == mode and r.json()["paused"] is True
    h = health(srv)
    assert h["status"] == "ok" and h["paused"] is True and h["pause_mode"] == mode
    late = complete_in_thread(srv, box, "late")  # accepted; waits for the resume
    wait_for(lambda: stats(srv)["num_waiting"] >= 1 + (mode == "retract"))
    tokens = stats(srv)["generation_tokens_total"]
    time.sleep(0.2)  # 10 steps' worth: nothing runs while paused
    assert stats(srv)["generation_tokens_total"] == tokens
    assert "r" not in box and "late" not in box
    assert post(srv, "/admin/resume").status_code == 200
    assert health(srv)["paused"] is False
    th.join(30)
    late.join(30)
    for key in ("r", "late"):
        assert box[key].status_code == 200, box[key].text
        choice = box[key].json()["choices"][0]
        assert choice["text"] == reference["text"] and choice["finish_reason"] == "length"
    assert (stats(srv)["num_preemptions"] > preempted) == (mode == "retract")
    wait_for(lambda: stats(srv)["kv_cache_usage"] == 0 and stats(srv)["num_running"] == 0)


@fake_only
def test_abort_mode_fails_in_flight_naming_the_pause(srv, reference):
    box: dict = {}
    th = in_flight(srv, box)
    assert post(srv, "/admin/pause", {"mode": "abort"}).status_code == 200
    th.join(30)
    assert box["r"].status_code == 500
    assert "generation paused (mode 'abort')" in box["r"].json()["error"]["message"]
    assert post(srv, "/admin/resume").status_code == 200
    r = post(srv, "/v1/completions", BODY)  # serving again, unchanged
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference["text"]


@fake_only
def test_wait_mode_answers_once_drained(srv, reference):
    box: dict = {}
    th = in_flight(srv, box)
    r = post(srv, "/admin/pause", {"mode": "wait"})
    assert r.status_code == 200 and r.json()["num_running"] == 0
    th.join(30)
    assert box["r"].status_code == 200
    assert box["r"].json()["choices"][0]["text"] == reference["text"]
    assert post(srv, "/admin/resume").status_code == 200


def test_bad_calls_are_clear_errors(srv):
    r = post(srv, "/admin/resume")
    assert r.status_code == 409 and "not paused" in r.json()["error"]["message"]
    r = post(srv, "/admin/pause", {"mode": "drop"})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "'drop'" in msg and "'retract'" in msg and r.json()["error"]["param"] == "mode"
    r = post(srv, "/admin/pause", {"mode": "keep", "extra": 1})
    assert r.status_code == 400
    assert post(srv, "/admin/pause", {"mode": "keep"}).status_code == 200
    r = post(srv, "/admin/pause", {"mode": "abort"})
    assert r.status_code == 409 and "already paused" in r.json()["error"]["message"]
    assert health(srv)["pause_mode"] == "keep"  # the refused pause changed nothing
    assert post(srv, "/admin/resume").status_code == 200
    assert health(srv)["paused"] is False


@fake_only
def test_sleep_and_wake_over_http(srv, reference):
    """Sleep (retract) with a request in flight: it and one sent while asleep wait, and
    finish unchanged after the wake; with reject_new a request is a 503 at once."""
    box: dict = {}
    th = in_flight(srv, box)
    r = post(srv, "/admin/sleep", {"level": 1, "mode": "retract"})
    assert r.status_code == 200 and r.json()["is_sleeping"] is True, r.text
    h = health(srv)
    assert h["is_sleeping"] is True and h["paused"] is True
    late = complete_in_thread(srv, box, "late")
    wait_for(lambda: stats(srv)["num_waiting"] == 2)
    assert "r" not in box and "late" not in box
    r = post(srv, "/admin/sleep", {"level": 2})
    assert r.status_code == 409 and "already asleep" in r.json()["error"]["message"]
    r = post(srv, "/admin/resume")
    assert r.status_code == 409 and "wake_up" in r.json()["error"]["message"]
    assert post(srv, "/admin/wake_up", {"tags": ["kv_cache"]}).json()["is_sleeping"] is False
    th.join(30)
    late.join(30)
    for key in ("r", "late"):
        assert box[key].status_code == 200, box[key].text
        assert box[key].json()["choices"][0]["text"] == reference["text"]
    assert health(srv)["is_sleeping"] is False and health(srv)["paused"] is False

    assert post(srv, "/admin/sleep", {"level": 2, "reject_new": True}).status_code == 200
    r = post(srv, "/v1/completions", BODY)
    assert r.status_code == 503 and "reject_new=True" in r.json()["error"]["message"]
    assert post(srv, "/admin/wake_up").status_code == 200  # no body: everything
    r = post(srv, "/v1/completions", BODY)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference["text"]


def test_bad_sleep_calls_are_clear_errors(srv):
    r = post(srv, "/admin/wake_up")
    assert r.status_code == 409 and "not asleep" in r.json()["error"]["message"]
    for body, param, words in [({"level": 3}, "level", "level=3"),
                               ({"mode": "keep"}, "mode", "cannot keep"),
                               ({"mode": "nap"}, "mode", "'nap'"),
                               ({"level": 1, "discard_weights": True}, "discard_weights",
                                "needs level 2")]:
        r = post(srv, "/admin/sleep", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert words in r.json()["error"]["message"]
    post(srv, "/admin/sleep", {})
    r = post(srv, "/admin/wake_up", {"tags": ["kv"]})
    assert r.status_code == 400 and "kv_cache" in r.json()["error"]["message"]
    assert health(srv)["is_sleeping"] is True  # the refused wake changed nothing
    assert post(srv, "/admin/wake_up", {"tags": None}).status_code == 200
    assert health(srv)["is_sleeping"] is False
