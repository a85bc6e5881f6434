"""Server-level failure classes from shared/cases.md: C08 C09 C11 C12 C13 C14 C19."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from .helpers import ENGINE_KIND, MODEL, fake_only, healthy_probe, make_engine, metrics_values, \
    running_server, wait_idle

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
M = 64


def free_blocks(srv) -> float:
    return metrics_values(httpx.get(srv.url("/metrics")).text)["jaxserve:num_free_blocks"]


def assert_idle(srv, baseline: float) -> None:
    m = wait_idle(srv, baseline)
    assert m["jaxserve:num_requests_running"] == 0
    assert m["jaxserve:num_requests_waiting"] == 0
    assert m["jaxserve:num_free_blocks"] == baseline
    healthy_probe(srv)


def sse_events(text: str) -> list:
    """Parse an SSE body into JSON objects, with the string "[DONE]" for the terminator."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


# ---------------------------------------------------------------- C11
@pytest.mark.parametrize("prompt_len,max_tokens,expect", [
    (M - 1, 1, (200, 1)),
    (M - 1, 10, (200, 1)),  # policy: the engine clamps to the room left, finish "length"
    (M, 1, (400, None)),
    (M + 1, 1, (400, None)),
    (M - 5, None, (200, 5)),  # omitted max_tokens -> up to max_model_len - prompt_len
])
def test_c11_max_model_len_boundary(server, prompt_len, max_tokens, expect):
    body = {"model": MODEL, "prompt": [7] * prompt_len, "temperature": 0, "ignore_eos": True}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    r = httpx.post(server.url(CMPL), json=body, timeout=30)
    status, ntok = expect
    if (prompt_len, max_tokens) == (M - 1, 10) and r.status_code == 400:
        ntok = None  # the other allowed policy: reject prompt + max_tokens > max_model_len
    elif r.status_code != status:
        pytest.fail(f"status {r.status_code}: {r.text}")
    if r.status_code == 200:
        body = r.json()
        assert body["usage"]["prompt_tokens"] == prompt_len
        assert body["usage"]["completion_tokens"] == ntok
        assert body["choices"][0]["finish_reason"] == "length"
        assert prompt_len + ntok <= M
    else:
        assert r.json()["error"]["param"] == "prompt"
    healthy_probe(server)


# ---------------------------------------------------------------- C12
@pytest.mark.parametrize("route,body", [
    (CMPL, {"prompt": ""}), (CMPL, {"prompt": [""]}), (CMPL, {"prompt": []}),
    (CMPL, {"prompt": [[]]}), (CHAT, {"messages": []}),
    (CHAT, {"messages": [{"role": "user", "content": ""}]}),
])
@pytest.mark.parametrize("stream", [False, True])
def test_c12_empty_prompt_never_kills_the_engine(server, route, body, stream):
    r = httpx.post(server.url(route), json={"model": MODEL, "max_tokens": 3, "stream": stream,
                                            "stream_options": {"include_usage": True} if stream
                                            else None, **body}, timeout=30)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 200:
        usage = (sse_events(r.text)[-2] if stream else r.json())["usage"]
        assert usage["prompt_tokens"] >= 1
    healthy_probe(server)


# ---------------------------------------------------------------- C13
@pytest.mark.parametrize("max_tokens", [0, -1, 0.5])
@pytest.mark.parametrize("route", [CMPL, CHAT])
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("stream", [False, True])
def test_c13_max_tokens_zero_or_invalid_is_400(server, max_tokens, route, n, stream):
    base = free_blocks(server)
    body = {"model": MODEL, "max_tokens": max_tokens, "n": n, "stream": stream}
    body.update({"prompt": "abc"} if route == CMPL else
                {"messages": [{"role": "user", "content": "abc"}]})
    r = httpx.post(server.url(route), json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert_idle(server, base)


def test_c13_null_max_tokens_means_up_to_max_model_len(server):
    r = httpx.post(server.url(CMPL), json={"model": MODEL, "prompt": [9] * 10, "max_tokens": None,
                                           "temperature": 0, "ignore_eos": True, "n": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2 * (M - 10)


# ---------------------------------------------------------------- C14
async def _one_token(client, url, prompt, n, stream):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "n": n,
            "stream": stream, "stream_options": {"include_usage": True} if stream else None}
    r = await client.post(url, json=body)
    assert r.status_code == 200, r.text
    if not stream:
        b = r.json()
        return {c["index"]: (c["text"], c["finish_reason"]) for c in b["choices"]}, b["usage"]
    ev = sse_events(r.text)
    out: dict[int, tuple[str, str | None]] = {}
    for e in ev[:-2]:
        for c in e["choices"]:
            t, f = out.get(c["index"], ("", None))
            out[c["index"]] = (t + c["text"], c["finish_reason"] or f)
    return out, ev[-2]["usage"]


def test_c14_max_tokens_one_concurrently(server):
    budget = server.engine.config.scheduler.max_num_batched_tokens
    prompts = ["hi", "q", [11] * (budget + 7), "x" * (M - 9)]  # two longer than the budget
    base = free_blocks(server)
    ref = {}
    for i, p in enumerate(prompts):
        r = httpx.post(server.url(CMPL), json={"model": MODEL, "prompt": p, "max_tokens": 8,
                                               "temperature": 0, "ignore_eos": True}).json()
        ids_text = r["choices"][0]["text"]
        ref[i] = ids_text[:1] if ids_text else ""

    async def main():
        async with httpx.AsyncClient(timeout=30) as client:
            jobs = [(i % len(prompts), 1 + i % 2, bool(i // 2 % 2)) for i in range(64)]
            res = await asyncio.gather(*(_one_token(client, server.url(CMPL), prompts[p], n, s)
                                         for p, n, s in jobs))
            return jobs, res

    for _ in range(5):
        jobs, res = asyncio.run(main())
        for (p, n, _), (choices, usage) in zip(jobs, res):
            assert usage["completion_tokens"] == n
            assert sorted(choices) == list(range(n))
            for text, finish in choices.values():
                assert finish in ("length", "stop")
                assert text == ref[p]
        assert_idle(server, base)


# ---------------------------------------------------------------- C19
@pytest.fixture(scope="module")
def chunky():
    """Token budget 16, max_model_len 256: a 64-token prompt is prefilled in 4 chunks."""
    with running_server(make_engine(max_model_len=256, max_num_batched_tokens=16,
                                    max_num_seqs=8, num_kv_blocks=513)) as srv:
        yield srv


C19_CASES = {
    "chunked_prefill_max1": dict(prompt="abcd" * 16, max_tokens=1),
    "n3": dict(prompt="usage", max_tokens=20, n=3, ignore_eos=True),
    "stop_string": dict(prompt="a", max_tokens=20, stop=["fg"]),
    # The FakeRunner counts from 63 to EOS (2) in 6 tokens; the tiny model just runs this case.
    "eos": dict(prompt=[63] if ENGINE_KIND == "fake" else [60], max_tokens=20),
    "length": dict(prompt="len", max_tokens=7, ignore_eos=True),
}


@pytest.mark.parametrize("case", sorted(C19_CASES))
@pytest.mark.parametrize("route", [CMPL, CHAT])
def test_c19_streaming_usage_equals_non_streaming(chunky, case, route):
    kw = dict(C19_CASES[case])
    if route == CHAT:
        p = kw.pop("prompt")
        text = p if isinstance(p, str) else bytes(p).decode("latin-1")
        kw["messages"] = [{"role": "user", "content": text}]
    body = {"model": MODEL, "temperature": 0, **kw}
    full = httpx.post(chunky.url(route), json=body, timeout=30)
    assert full.status_code == 200, full.text
    full = full.json()
    r = httpx.post(chunky.url(route), json={**body, "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}}, timeout=30)
    ev = sse_events(r.text)
    assert ev[-1] == "[DONE]"
    usage_only = [e for e in ev[:-1] if e["choices"] == []]
    assert len(usage_only) == 1 and ev[-2] is usage_only[0]  # exactly one, right before [DONE]
    final = usage_only[0]["usage"]
    assert final == full["usage"]
    assert final["total_tokens"] == final["prompt_tokens"] + final["completion_tokens"]
    per_choice = sum(1 for _ in full["choices"])
    assert per_choice == kw.get("n", 1)
    # per-chunk usage: constant prompt_tokens, non-decreasing completion_tokens ending at final
    seq = [e["usage"] for e in ev[:-2]]
    assert all(u["prompt_tokens"] == final["prompt_tokens"] for u in seq)
    comp = [u["completion_tokens"] for u in seq]
    assert comp == sorted(comp) and comp[-1] == final["completion_tokens"]
    # streamed text per choice == non-streamed text
    texts: dict[int, str] = {}
    for e in ev[:-2]:
        for c in e["choices"]:
            piece = c["text"] if route == CMPL else c["delta"].get("content", "")
            texts[c["index"]] = texts.get(c["index"], "") + piece
    want = {c["index"]: c["text"] if route == CMPL else c["message"]["content"]
            for c in full["choices"]}
    assert texts == want


@fake_only
def test_c19_hand_checked_counts(chunky):
    r = httpx.post(chunky.url(CMPL), json={"model": MODEL, "prompt": "abcd" * 16, "max_tokens": 1,
                                           "temperature": 0}).json()
    assert r["usage"] == {"prompt_tokens": 64, "completion_tokens": 1, "total_tokens": 65}
    r = httpx.post(chunky.url(CMPL), json={"model": MODEL, "prompt": [63], "max_tokens": 20,
                                           "temperature": 0}).json()
    assert r["usage"]["completion_tokens"] == 6  # 64 65 66 0 1, then EOS 2 (counted, no text)
    r = httpx.post(chunky.url(CHAT), json={"model": MODEL, "max_tokens": 20, "temperature": 0,
                                           "n": 3, "ignore_eos": True,
                                           "messages": [{"role": "user", "content": "usage"}]})
    prompt_tokens = 1 + len("user usage") + 1 + len("assistant ")  # the tiny chat template
    assert r.json()["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 60,
                                 "total_tokens": 82}


# ---------------------------------------------------------------- C09
@pytest.fixture(scope="module")
def small_pool():
    """17 blocks (16 usable) of 4 tokens = 64 KV tokens, but max_model_len 128."""
    with running_server(make_engine(max_model_len=128, num_kv_blocks=17, max_num_seqs=4,
                                    max_num_batched_tokens=32)) as srv:
        yield srv


def test_c09_request_larger_than_pool_is_rejected_without_starving(small_pool):
    srv = small_pool
    base = free_blocks(srv)

    async def main():
        async with httpx.AsyncClient(timeout=30) as client:
            t0 = time.monotonic()
            big = client.post(srv.url(CMPL), json={"model": MODEL, "prompt": [5] * 100,
                                                   "max_tokens": 4})
            small = [client.post(srv.url(CMPL), json={"model": MODEL, "prompt": f"s{i}",
                                                      "max_tokens": 4, "ignore_eos": True})
                     for i in range(3)]
            rs = await asyncio.gather(big, *small)
            return rs, time.monotonic() - t0

    rs, dt = asyncio.run(main())
    assert rs[0].status_code == 400 and "blocks" in rs[0].json()["error"]["message"], rs[0].text
    assert dt < 5
    for r in rs[1:]:
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert_idle(srv, base)


@fake_only
@pytest.mark.parametrize("prompt_len,ok", [(60, True), (61, True), (62, False)])
def test_c09_pool_boundary(small_pool, prompt_len, ok):
    # The scheduler needs ceil((prompt + max_tokens - 1) / 4) blocks (the last output token's
    # KV is never written): 61 + 4 - 1 = 64 tokens = 16 blocks, the whole usable pool.
    r = httpx.post(small_pool.url(CMPL), json={"model": MODEL, "prompt": [5] * prompt_len,
                                               "max_tokens": 4, "ignore_eos": True}, timeout=30)
    assert r.status_code == (200 if ok else 400), r.text
    healthy_probe(small_pool)
