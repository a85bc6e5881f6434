"""Load: 200 concurrent streams of random lengths, 10% of clients vanish mid-way."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx

from .helpers import MODEL, healthy_probe, make_engine, metrics_values, running_server, wait_idle

NUM_REQUESTS = 200


async def _one(client, url, rng: random.Random, i: int) -> tuple[str, int, int | None, str | None]:
    want = rng.randint(1, 40)
    prompt = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(1, 40)))
    drop_after = rng.randint(0, want) if i % 10 == 0 else None  # 10% disconnect
    body = {"model": MODEL, "prompt": prompt, "max_tokens": want, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    usage, finish, chunks = None, None, 0
    async with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200, await r.aread()
        if drop_after == 0:
            return "dropped", want, None, None
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev["choices"]:
                chunks += 1
                finish = ev["choices"][0]["finish_reason"] or finish
            elif ev.get("usage"):
                usage = ev["usage"]["completion_tokens"]
            if drop_after is not None and chunks >= drop_after:
                return "dropped", want, None, None
    return "done", want, usage, finish


def test_200_concurrent_streams_with_disconnects():
    with running_server(make_engine(max_model_len=128, max_num_batched_tokens=128,
                                    max_num_seqs=64, num_kv_blocks=1025)) as srv:
        baseline = metrics_values(httpx.get(srv.url("/metrics")).text)
        rng = random.Random(1234)

        async def main():
            limits = httpx.Limits(max_connections=NUM_REQUESTS + 10)
            async with httpx.AsyncClient(timeout=60, limits=limits) as client:
                return await asyncio.gather(*(_one(client, srv.url("/v1/completions"), rng, i)
                                              for i in range(NUM_REQUESTS)))

        t0 = time.monotonic()
        results = asyncio.run(main())
        elapsed = time.monotonic() - t0
        done = [r for r in results if r[0] == "done"]
        assert len(done) >= NUM_REQUESTS * 0.9 - 1
        for _, want, usage, finish in done:
            assert usage == want and finish == "length"
        m = wait_idle(srv, baseline["jaxserve:num_free_blocks"])
        assert m["jaxserve:num_requests_running"] == 0
        assert m["jaxserve:num_requests_waiting"] == 0
        assert m["jaxserve:kv_cache_usage_perc"] == baseline["jaxserve:kv_cache_usage_perc"]
        assert m["jaxserve:num_free_blocks"] == baseline["jaxserve:num_free_blocks"]
        # Every completed request's tokens are counted; dropped ones add at most their cap.
        gen = m["jaxserve:generation_tokens_total"]
        assert gen >= sum(w for _, w, _, _ in done)
        assert gen <= sum(w for _, w, _, _ in results)
        healthy_probe(srv)
        assert elapsed < 20, f"load test took {elapsed:.1f} s"
