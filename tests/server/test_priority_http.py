"""`priority` in the HTTP bodies: 400 under fcfs (vLLM), honoured under --scheduling_policy
priority (fake runner: one sequence at a time, so the start order is the priority order)."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import openai
import pytest

from .helpers import MODEL, fake_engine, fake_only, healthy_probe, running_server


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "ab", "max_tokens": 2, "priority": -1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 2,
                              "priority": 4}),
])
def test_nonzero_priority_under_fcfs_is_a_400(server, path, body):
    r = httpx.post(server.url(path), json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "priority"
    assert err["message"] == (f"priority={body['priority']}: must be 0 unless the engine runs "
                              "scheduling_policy='priority' (it runs 'fcfs')")
    healthy_probe(server)


@pytest.mark.parametrize("value", [2**63, "1", 1.5, True])
def test_priority_of_the_wrong_type_or_range_is_a_400(server, value):
    r = httpx.post(server.url("/v1/completions"), json={
        "model": MODEL, "prompt": "ab", "max_tokens": 1, "priority": value}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "priority"


@fake_only
def test_priority_policy_server_runs_lower_priority_first():
    eng = fake_engine(scheduling_policy="priority", max_num_seqs=1, step_delay=0.05)
    with running_server(eng) as srv:
        client = openai.OpenAI(base_url=srv.url("/v1"), api_key="unused", max_retries=0)

        def ask(prompt: str, priority: int):
            return client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                extra_body={"priority": priority, "ignore_eos": True})

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            first = pool.submit(ask, "a", 0)  # occupies the only sequence slot
            time.sleep(0.05)
            low = pool.submit(ask, "b", 9)
            time.sleep(0.05)
            high = pool.submit(ask, "c", -3)  # arrives last, runs before "b"
            done = []
            for f in concurrent.futures.as_completed([first, low, high]):
                done.append(f.result().choices[0].text)
        # counting tokens: "a" -> "bcdefghi", "c" -> "defghijk", "b" -> "cdefghij".
        assert done == ["bcdefghi", "defghijk", "cdefghij"]
