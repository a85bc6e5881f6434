"""C08: a client that goes away (mid-stream, mid-prefill, n>1, timeout, queued) frees its KV."""

from __future__ import annotations

import asyncio
import functools
import time

import httpx
import pytest

from .helpers import ENGINE_KIND, MODEL, fake_only, healthy_probe, make_engine, metrics_values, \
    running_server, wait_idle

CMPL = "/v1/completions"
BUDGET = 16


@pytest.fixture(scope="module", params=["thread", pytest.param("process", marks=fake_only)])
def srv(request):
    """The engine on the server's thread, then in its own process (engine_process=True;
    the fake-engine pass only: the split is the server's plumbing)."""
    factory = functools.partial(make_engine, max_model_len=512, max_num_batched_tokens=BUDGET,
                                max_num_seqs=8, num_kv_blocks=4097, step_delay=0.002)
    process = request.param == "process"
    with running_server(factory if process else factory(), engine_process=process) as s:
        yield s


def _body(**kw):
    return {"model": MODEL, "temperature": 0, "ignore_eos": True, "max_tokens": 384,
            "prompt": "long", **kw}


async def _stream_then_close(client, url, body, chunks: int) -> int:
    """Open a stream, read `chunks` data lines (0 = none), close; return lines read."""
    got = 0
    async with client.stream("POST", url, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        if chunks == 0:
            return 0
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                got += 1
                if got >= chunks:
                    break
    return got


def _gen_tokens(s) -> float:
    return metrics_values(httpx.get(s.url("/metrics")).text)["jaxserve:generation_tokens_total"]


def _assert_released(s, baseline: float) -> None:
    m = wait_idle(s, baseline)
    assert (m["jaxserve:num_requests_running"], m["jaxserve:num_requests_waiting"]) == (0, 0)
    assert m["jaxserve:num_free_blocks"] == baseline
    before = _gen_tokens(s)
    time.sleep(0.1)
    assert _gen_tokens(s) == before, "an aborted request kept generating"
    healthy_probe(s)


def test_c08_disconnect_mid_stream_mid_prefill_and_n3(srv):
    baseline = metrics_values(httpx.get(srv.url("/metrics")).text)["jaxserve:num_free_blocks"]
    url = srv.url(CMPL)
    aborted0 = srv.async_engine.stats["num_aborted"]  # the engine's, from either process

    async def main():
        async with httpx.AsyncClient(timeout=30) as client:
            for _ in range(20):
                await asyncio.gather(
                    _stream_then_close(client, url, _body(), 1),  # (a) after the first chunk
                    _stream_then_close(client, url, _body(prompt=[7] * (8 * BUDGET)), 0),  # (b)
                    _stream_then_close(client, url, _body(n=3), 2),  # (c) n=3
                )

    asyncio.run(main())
    _assert_released(srv, baseline)
    if ENGINE_KIND == "fake":
        assert srv.async_engine.stats["num_aborted"] - aborted0 == 60


def test_c08_non_stream_client_timeout(srv):
    baseline = metrics_values(httpx.get(srv.url("/metrics")).text)["jaxserve:num_free_blocks"]
    for _ in range(5):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url(CMPL), json=_body(), timeout=httpx.Timeout(30, read=0.15))
    _assert_released(srv, baseline)


def test_c08_disconnect_while_queued(srv):
    baseline = metrics_values(httpx.get(srv.url("/metrics")).text)["jaxserve:num_free_blocks"]
    url = srv.url(CMPL)

    async def main():
        async with httpx.AsyncClient(timeout=30) as client:
            holders = [asyncio.create_task(_stream_then_close(client, url, _body(), 10**9))
                       for _ in range(8)]  # fill max_num_seqs=8 with long generations
            deadline = time.monotonic() + 5
            while True:
                m = metrics_values((await client.get(srv.url("/metrics"))).text)
                if m["jaxserve:num_requests_running"] == 8 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.01)
            assert m["jaxserve:num_requests_running"] == 8
            for _ in range(5):  # (e) queued behind them, then gone
                await _stream_then_close(client, url, _body(prompt="queued"), 0)
            # The queued ones must leave the waiting queue while the 8 still run.
            deadline = time.monotonic() + 2
            while True:
                m = metrics_values((await client.get(srv.url("/metrics"))).text)
                if m["jaxserve:num_requests_waiting"] == 0 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.01)
            assert m["jaxserve:num_requests_running"] == 8
            for h in holders:
                h.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
            return m

    m = asyncio.run(main())
    assert m["jaxserve:num_requests_waiting"] == 0  # aborted, not left behind
    _assert_released(srv, baseline)
