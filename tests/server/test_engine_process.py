"""The engine in its own process (`build_app(..., engine_process=True)`, issue 24).

The same routes, streams and failure handling as with the engine on a thread: the text a
request gets, a client that goes away (its KV comes back), an admin call (a closure sent
to the engine process), the overload 503, and what happens when the engine process dies
or its factory fails. Three spawned engine processes in all.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import threading
import time

import httpx
import pytest

from jaxserve.server.async_engine import AddRequestError, EngineRequest
from jaxserve.server.engine_process import ProcessAsyncEngine
from jaxserve.sampling_params import SamplingParams

from .helpers import (ENGINE_KIND, MODEL, fake_only, healthy_probe, make_engine,
                      metrics_values, running_server, wait_idle)

CMPL = "/v1/completions"


@pytest.fixture(scope="module")
def srv():
    factory = functools.partial(make_engine, max_model_len=512, max_num_seqs=8,
                                num_kv_blocks=4097, step_delay=0.002)
    with running_server(factory, engine_process=True, max_queued_requests=4) as s:
        yield s


def _sse_text(lines: list[str]) -> tuple[str, str | None]:
    text, finish = "", None
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
    return text, finish


@fake_only
def test_stream_and_plain_completion_give_the_counting_text(srv):
    # The fake counts on from the prompt's last character: "abc" -> "defgh".
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 5, "temperature": 0,
            "ignore_eos": True}
    r = httpx.post(srv.url(CMPL), json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "defgh"
    with httpx.stream("POST", srv.url(CMPL), json={**body, "stream": True}, timeout=30) as s:
        lines = list(s.iter_lines())
    assert _sse_text(lines) == ("defgh", "length")
    assert [l for l in lines if l][-1] == "data: [DONE]"


def test_engine_runs_in_another_process_and_reports_its_view(srv):
    ae = srv.async_engine
    assert isinstance(ae, ProcessAsyncEngine)
    assert ae.pid is not None and ae.pid != os.getpid()
    assert ae.engine.config.scheduler.max_model_len == 512
    assert ae.engine.tokenizer.decode(ae.engine.tokenizer.encode("abc")) == "abc"
    models = httpx.get(srv.url("/v1/models")).json()["data"]
    assert [m["id"] for m in models] == [MODEL] and models[0]["max_model_len"] == 512
    assert httpx.get(srv.url("/health")).json()["status"] == "ok"


def test_client_going_away_frees_its_kv_and_calls_reach_the_engine(srv):
    baseline = metrics_values(httpx.get(srv.url("/metrics")).text)["jaxserve:num_free_blocks"]

    async def go() -> int:
        got = 0
        async with httpx.AsyncClient(timeout=30) as client:
            body = {"model": MODEL, "prompt": "long", "max_tokens": 400, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            async with client.stream("POST", srv.url(CMPL), json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    got += line.startswith("data: ")
                    if got >= 3:
                        break
        return got

    assert asyncio.run(go()) == 3
    m = wait_idle(srv, baseline)
    assert (m["jaxserve:num_requests_running"], m["jaxserve:num_requests_waiting"]) == (0, 0)
    assert m["jaxserve:num_free_blocks"] == baseline
    healthy_probe(srv)
    # /reset_prefix_cache sends a closure to the engine process and returns its int;
    # the probe's prompt blocks were cached, so some are freed.
    r = httpx.post(srv.url("/reset_prefix_cache"))
    assert r.status_code == 200 and r.json()["blocks_freed"] >= 1, r.text
    assert httpx.post(srv.url("/reset_prefix_cache")).json()["blocks_freed"] == 0


def test_call_returns_the_engines_value_or_raises_its_error(srv):
    ae = srv.async_engine

    def call(fn):
        return asyncio.run_coroutine_threadsafe(ae.call(fn), ae._loop).result(30)

    assert call(lambda e: (e.config.scheduler.max_num_seqs, os.getpid())) == (8, ae.pid)

    def bad(e):
        raise ValueError(f"no adapter; max_num_seqs={e.config.scheduler.max_num_seqs}")

    with pytest.raises(ValueError, match="no adapter; max_num_seqs=8"):
        call(bad)
    with pytest.raises(RuntimeError, match="could not be sent"):
        call(lambda e: threading.Lock())  # the engine's result cannot be pickled
    healthy_probe(srv)


def test_an_engine_side_rejection_keeps_its_type_and_index(srv):
    """add_request's ValueError (a duplicate id here) crosses back as the AddRequestError
    the routes turn into a 400, with the index of the request it names."""
    ae = srv.async_engine
    sp = SamplingParams(max_tokens=2)
    reqs = [EngineRequest("dup", [4, 5], sp), EngineRequest("dup", [6, 7], sp)]
    with pytest.raises(AddRequestError, match="dup") as e:
        asyncio.run_coroutine_threadsafe(ae.submit(reqs), ae._loop).result(30)
    assert e.value.index == 1
    healthy_probe(srv)


def test_finished_requests_and_steps_reach_the_metrics(srv):
    def values():
        return metrics_values(httpx.get(srv.url("/metrics")).text)

    before = values()
    healthy_probe(srv)  # 3 tokens, finish_reason "length"
    after = values()
    key = "jaxserve:request_success_total{finished_reason=length}"
    assert after[key] == before.get(key, 0) + 1
    steps = "jaxserve:iteration_tokens_total_count"
    assert after[steps] >= before.get(steps, 0) + 2  # on_step ran for the new steps


def test_a_call_whose_caller_gave_up_is_skipped_by_the_engine(srv):
    """A call queued behind a slow one and cancelled meanwhile never runs (AsyncEngine
    skips a cancelled command; the cancel crosses to the engine process)."""
    ae = srv.async_engine

    async def run() -> bool:
        slow = asyncio.ensure_future(ae.call(lambda e: time.sleep(1.0)))
        await asyncio.sleep(0.2)  # the slow call is running in the engine's loop
        late = asyncio.ensure_future(ae.call(lambda e: setattr(e, "_late_ran", True)))
        await asyncio.sleep(0.2)  # sent, queued behind the slow one
        late.cancel()
        await slow
        return await ae.call(lambda e: getattr(e, "_late_ran", False))

    ran = asyncio.run_coroutine_threadsafe(run(), ae._loop).result(30)
    assert ran is False
    assert not ae.calls  # nothing left waiting for a reply


def test_overload_is_a_503_from_the_engine_process(srv):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 2, "n": 5, "temperature": 0.5,
            "seed": 1}  # 5 waiting children > max_queued_requests=4
    r = httpx.post(srv.url(CMPL), json=body, timeout=30)
    assert r.status_code == 503, r.text
    assert "max_queued_requests=4" in r.json()["error"]["message"]
    assert r.headers.get("retry-after")


def _started(factory) -> tuple[ProcessAsyncEngine, asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    ae = ProcessAsyncEngine(factory)
    ae.start(loop)
    assert ae.wait_ready(120) or ae.state == "failed"
    return ae, loop


@fake_only
def test_engine_process_death_ends_open_streams_with_an_error():
    ae, loop = _started(functools.partial(make_engine, max_model_len=512, step_delay=0.005))
    try:
        assert ae.state == "ready", ae.error
        req = EngineRequest("r0", [4, 5, 6], SamplingParams(max_tokens=400, ignore_eos=True))

        async def run() -> list:
            group = await ae.submit([req])
            first = await group.next()
            os.kill(ae.pid, signal.SIGKILL)
            seen = [first]
            async for d in group:
                seen.append(d)
            return seen

        seen = loop.run_until_complete(asyncio.wait_for(run(), 60))
        assert seen[0].error is None and seen[0].outputs
        last = seen[-1]
        assert last.finished and last.status == 500
        assert "engine process exited" in last.error
        assert ae.state == "failed" and "exit code -9" in ae.error
        with pytest.raises(RuntimeError, match="engine is failed"):
            loop.run_until_complete(ae.call(lambda e: 1))
    finally:
        t0 = time.monotonic()
        ae.stop()
        assert time.monotonic() - t0 < 5
        loop.close()


def _broken_factory():
    raise ValueError("no such model: nowhere.gguf")


@fake_only
def test_factory_failure_is_reported_and_an_engine_object_is_refused():
    with pytest.raises(ValueError, match="zero-argument engine factory"):
        ProcessAsyncEngine(make_engine(max_model_len=64) if ENGINE_KIND == "fake" else object())
    ae, loop = _started(_broken_factory)
    try:
        assert ae.state == "failed"
        assert "ValueError: no such model: nowhere.gguf" in ae.error
    finally:
        ae.stop()
        loop.close()
    assert ae._proc.returncode == 0


def _engine_with_unpicklable_name():
    engine = make_engine(max_model_len=64)
    engine.model_name = threading.Lock()  # the view sent to the API process holds it
    return engine


def _engine_with_unpicklable_stats():
    engine = make_engine(max_model_len=64)
    stats = engine.get_stats
    engine.get_stats = lambda: dict(stats(), lock=threading.Lock())
    return engine


@fake_only
@pytest.mark.parametrize("factory, why", [
    (_engine_with_unpicklable_name, "could not be sent to the API process"),
    (_engine_with_unpicklable_stats, "message 'out' could not be sent")])
def test_a_message_that_cannot_cross_fails_the_engine_never_hangs(factory, why):
    ae, loop = _started(factory)
    try:
        deadline = time.monotonic() + 60
        while ae.state != "failed":  # "fatal" may come just after "ready"
            assert time.monotonic() < deadline, ae.state
            time.sleep(0.05)
        assert why in ae.error
    finally:
        ae.stop()
        loop.close()
    assert ae._proc.poll() is not None


@fake_only
def test_commands_never_block_their_caller_and_keep_their_order():
    """`put` only queues: a slow send (a call holding a weight tree) happens on the sender
    thread, never on the event loop, and commands reach the socket in order."""
    ae = ProcessAsyncEngine(functools.partial(make_engine, max_model_len=64))
    gate, sent = threading.Event(), []

    class SlowConn:
        def send(self, msg):
            gate.wait(10)
            sent.append(msg)

    ae.conn = SlowConn()
    ae._commands.start()
    t0 = time.monotonic()
    ae._commands.put(("abort", ["a"]))
    ae._commands.put(("abort", ["b"]))
    assert time.monotonic() - t0 < 0.5 and sent == []  # queued, the first send blocked
    gate.set()
    ae._commands.close()
    assert sent == [("abort", ["a"]), ("abort", ["b"])]
