"""Progressive warm-up (issue 12): ready after the smallest token bucket's and the seq
buckets' programs, the larger buckets built in a background thread while the scheduler
caps every step at the largest ready bucket; strict_compiles still refuses a late one.

The background build is gated (a `threading.Event` in front of `ProgramTable.build`), so
the "serving while warming up" phase is deterministic, not a race against the compiler.
The oracle is the unpaged `reference_greedy` of tests/engine/test_engine.py.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from conftest import tiny_params, tiny_tokenizer
from jaxserve.config import SchedulerConfig
from jaxserve.engine import LLMEngine, make_engine_config
from jaxserve.scheduler.buckets import BucketPolicy
from jaxserve.scheduler.scheduler import Scheduler
from jaxserve.scheduler.request import Request
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.fake_runner import FakeRunner
from engine.test_engine import cached_reference, greedy, prompt_of, run_all

ARGS = dict(max_model_len=128, block_size=4, num_kv_blocks=128, max_num_seqs=8,
            max_num_batched_tokens=32, token_buckets=(8, 32), seq_buckets=(8,),
            attention_backend="xla", strict_compiles=True,
            enable_prompt_logprobs=False)  # stack + head programs only: counts below


def test_program_stages_partition_program_keys():
    p = BucketPolicy((8, 16, 64), (4, 8, 32))
    stages = p.program_stages()
    assert [cap for cap, _ in stages] == [8, 16, 64]
    # Stage 0: the smallest stack and the heads a step of <= 8 tokens can need (<= 8
    # sequences); seq bucket 32 covers 9..32 sequences, first reachable at 16 tokens.
    assert stages[0][1] == [("stack", 8), ("head", 4), ("head", 8)]
    assert stages[1][1] == [("stack", 16), ("head", 32)]
    assert stages[2][1] == [("stack", 64)]
    # The score family (one per token bucket, prompt logprobs) follows its stack.
    stages = p.program_stages(score=True)
    assert set(stages[0][1]) == {("stack", 8), ("score", 8), ("head", 4), ("head", 8)}
    assert set(stages[1][1]) == {("stack", 16), ("score", 16), ("head", 32)}
    assert set(stages[2][1]) == {("stack", 64), ("score", 64)}
    flat = [k for _, keys in stages for k in keys]
    assert sorted(flat) == sorted(p.program_keys(score=True)) and len(flat) == len(set(flat))
    assert p.token_budget() == 64
    assert p.token_budget(16) == 16
    # ready_tokens (the runner's READY_TOKENS = 8): stage 0 takes every bucket up to it.
    q = BucketPolicy((1, 2, 4, 8, 16), (1, 2, 4, 8))
    stages = q.program_stages(ready_tokens=8)
    assert [cap for cap, _ in stages] == [8, 16]
    assert set(stages[0][1]) == {("stack", t) for t in (1, 2, 4, 8)} | {
        ("head", s) for s in (1, 2, 4, 8)}
    assert stages[1][1] == [("stack", 16)]
    assert [cap for cap, _ in q.program_stages(ready_tokens=3)] == [2, 4, 8, 16]
    assert [cap for cap, _ in q.program_stages()] == [1, 2, 4, 8, 16]


def test_the_compile_command_builds_exactly_the_warmup_set():
    """`jaxserve compile` (jaxserve.gpu.deviceless) compiles `ModelRunner.warmup_keys()`:
    the stages above flattened in build order, each key once, and exactly what a full
    warm-up builds (the deviceless test checks the GPU side against the same set)."""
    cfg, params = tiny_params()
    config = make_engine_config(cfg, **dict(ARGS, enable_prompt_logprobs=True))
    engine = LLMEngine(config, params, tiny_tokenizer(), model_name="tiny", warmup=False)
    runner, policy = engine.runner, engine.bucket_policy
    keys = runner.warmup_keys()
    assert keys == [k for _, ks in policy.program_stages(score=True, ready_tokens=8) for k in ks]
    assert sorted(keys) == sorted(policy.program_keys(score=True)) == [
        ("head", 8), ("score", 8), ("score", 32), ("stack", 8), ("stack", 32)]
    assert len(set(keys)) == len(keys)
    runner.warmup(progress=False, mode="full")
    assert set(runner.programs.programs) == set(keys)


def test_scheduler_never_plans_past_the_token_cap():
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256,
                          token_buckets=(8, 16, 64))
    from jaxserve.config import CacheConfig

    sched = Scheduler(cfg, CacheConfig(block_size=4, num_kv_blocks=200))
    runner = FakeRunner(sched, check_invariants=True)
    runner.token_cap = 8
    reqs = [Request(f"r{i}", prompt_of(n, salt=i), SamplingParams(max_tokens=5, ignore_eos=True))
            for i, n in enumerate((30, 3, 17, 9, 40, 1))]
    for r in reqs:
        sched.add_request(r)
    sizes = []
    while sched.has_unfinished_requests():
        res = runner.step()
        sizes.append((res.out.num_scheduled_tokens, res.out.token_bucket))
        if len(sizes) == 12:
            runner.token_cap = None  # the background warm-up finished
    capped, full = sizes[:12], sizes[12:]
    assert all(n <= 8 and t == 8 for n, t in capped), capped
    assert max(n for n, _ in full) > 8, full  # the remaining prefill uses the big buckets
    assert all(len(r.output_token_ids) == 5 for r in reqs)


def _gated_engine(**over):
    """A progressive tiny engine whose background builds wait for `gate`."""
    cfg, params = tiny_params()
    config = make_engine_config(cfg, **dict(ARGS, warmup="progressive", **over))
    engine = LLMEngine(config, params, tiny_tokenizer(), model_name="tiny", warmup=False)
    runner, gate = engine.runner, threading.Event()
    build = runner.programs.build
    first_t = engine.bucket_policy.token_buckets[0]

    def gated_build(key):
        if key[0] == "stack" and key[1] > first_t and threading.current_thread().name == \
                "jaxserve-warmup":
            assert gate.wait(600), "test gate never opened"
        return build(key)

    runner.programs.build = gated_build
    return engine, gate


REQUESTS = [(f"w{i}", prompt_of(n, salt=70 + i), greedy(m))
            for i, (n, m) in enumerate(((20, 6), (33, 4), (5, 8), (47, 3), (12, 7), (9, 5)))]


def test_progressive_warmup_under_load_same_tokens_and_strict_refusal():
    engine, gate = _gated_engine()
    runner, policy = engine.runner, engine.bucket_policy
    try:
        runner.warmup(progress=False)  # returns with stage 0 built
        st = runner.stats()
        assert (st.programs_ready, st.warmup_programs, st.warmup_done) == (2, 3, False)
        assert runner.token_cap == 8 and engine.get_stats()["programs_ready"] == 2
        shapes_while_warming: dict = {}

        def before_step(eng, step):
            if step == 10:  # mid-prefill: let the background build finish
                shapes_while_warming.update(runner.stats().steps_by_shape)
                gate.set()
                assert runner.wait_warmup(300)

        done = run_all(engine, REQUESTS, before_step=before_step)
        assert shapes_while_warming and all(t == 8 for t, _ in shapes_while_warming), \
            shapes_while_warming  # capped: every step before the gate opened ran at T=8
        assert any(t == 32 for t, _ in runner.stats().steps_by_shape)  # then the big bucket
        for rid, prompt, sp in REQUESTS:
            assert done[rid].outputs[0].token_ids == cached_reference(tuple(prompt),
                                                                      sp.max_tokens), rid
        st = runner.stats()
        assert st.warmup_done and st.programs_ready == 3 and st.late_compiles == 0
        assert runner.token_cap is None
    finally:
        gate.set()
        runner.close()


def test_a_step_past_the_cap_is_a_counted_strict_refusal():
    # Bypass the cap while the 32-token stack is still blocked: the step needs a program
    # warm-up has not built yet; strict mode refuses it (never compiled on the request
    # path) and counts it as a late compile.
    engine, gate = _gated_engine()
    runner, policy = engine.runner, engine.bucket_policy
    try:
        runner.warmup(progress=False)
        runner._warmup.token_cap = None  # what the engine passes to schedule()
        P = prompt_of(25, salt=90)
        out = run_all(engine, [("late", P, greedy(2))])["late"].outputs[0]
        assert out.finish_reason == "error" and "no stack program for bucket 32" in out.error
        assert runner.stats().late_compiles >= 1
        assert engine.get_stats()["num_compiles_after_warmup"] == runner.stats().late_compiles
        assert ("stack", 32) not in runner.programs.programs  # refused, not compiled on the step
        runner._warmup.token_cap = 8
        gate.set()
        assert runner.wait_warmup(300)
        out = run_all(engine, [("after", P, greedy(2))])["after"].outputs[0]
        assert out.token_ids == cached_reference(tuple(P), 2)
    finally:
        gate.set()
        runner.close()


PROMPTS = ["hello there", "abc", "The quick brown fox jumps over", "x" * 40]


def _ask_all(srv) -> list[str]:
    """PROMPTS as concurrent greedy completions; their texts, in order."""
    results: dict = {}

    def ask(i, p):
        results[i] = httpx.post(srv.url("/v1/completions"), timeout=300, json={
            "model": "tiny", "prompt": p, "max_tokens": 5, "temperature": 0, "ignore_eos": True})

    threads = [threading.Thread(target=ask, args=(i, p)) for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for i in range(len(PROMPTS)):
        assert results[i].status_code == 200, results[i].text
    return [results[i].json()["choices"][0]["text"] for i in range(len(PROMPTS))]


def test_server_is_healthy_and_serves_during_progressive_warmup():
    from server.helpers import metrics_values, running_server

    holder: dict = {}

    def factory():
        engine, gate = _gated_engine()
        holder["gate"] = gate
        engine.runner.warmup(progress=False)
        return engine

    try:
        with running_server(factory, served_model_name="tiny", wait_ready=False) as srv:
            deadline = time.monotonic() + 300  # stage 0 is two real compiles
            while httpx.get(srv.url("/health")).status_code != 200:
                assert time.monotonic() < deadline, "engine did not become ready"
                time.sleep(0.05)
            assert httpx.get(srv.url("/health")).json() == {
                "status": "ok", "programs_ready": 2, "programs_total": 3, "warmup_done": False,
                "paused": False, "pause_mode": None, "is_sleeping": False}
            during = _ask_all(srv)  # concurrent, all while the 32-token bucket is missing
            m = metrics_values(httpx.get(srv.url("/metrics")).text)
            assert m["jaxserve:programs_ready"] == 2 and m["jaxserve:warmup_done"] == 0
            assert m["jaxserve:num_compiles_after_warmup_total"] == 0
            runner = srv.async_engine.engine.runner
            shapes = dict(runner.stats().steps_by_shape)
            assert shapes and all(t == 8 for t, _ in shapes), shapes
            holder["gate"].set()
            while True:
                m = metrics_values(httpx.get(srv.url("/metrics")).text)
                if m["jaxserve:warmup_done"] == 1 or time.monotonic() > deadline + 300:
                    break
                time.sleep(0.1)
            assert m["jaxserve:programs_ready"] == 3 == m["jaxserve:programs_total"]
            assert httpx.get(srv.url("/health")).json()["warmup_done"] is True
            assert _ask_all(srv) == during  # the same tokens after full warm-up
            # A fresh 30-token prompt (no prefix-cache hit, unlike the repeated PROMPTS)
            # prefills in one step: the 32-token bucket, now that it is built.
            r = httpx.post(srv.url("/v1/completions"), timeout=300, json={
                "model": "tiny", "prompt": "z" * 30, "max_tokens": 1, "temperature": 0})
            assert r.status_code == 200, r.text
            assert any(t == 32 for t, _ in runner.stats().steps_by_shape)
    finally:
        if "gate" in holder:
            holder["gate"].set()
