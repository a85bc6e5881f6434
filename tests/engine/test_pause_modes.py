"""Pause modes around a weight swap (issue 28) on the tiny model: abort, wait,
keep, retract, with requests in flight.

References come from the same engine with the other weights loaded by
`update_params` (test_research_api checks that equals a freshly built engine).
"""

from __future__ import annotations

import functools

import pytest

from conftest import drain, tiny_engine, tiny_params
from jaxserve.sampling_params import SamplingParams

PROMPTS = {"a": [5, 9, 13, 2], "b": [7, 7, 3], "c": [11, 4, 6, 8, 1]}
N = 8  # max_tokens
K = 3  # steps run on the old weights before the swap


@functools.lru_cache(maxsize=None)
def params(seed):
    return tiny_params(seed)[1]


def greedy(n=N):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def reference(eng, seed, prompts, n=N):
    """Greedy tokens of `prompts` under weights `seed` (loaded by update_params)."""
    eng.update_params(params(seed))
    for rid, p in prompts.items():
        eng.add_request("ref-" + rid, p, greedy(n))
    outs = drain(eng)
    return {rid: outs["ref-" + rid].outputs[0].token_ids for rid in prompts}


@pytest.fixture
def eng():
    e = tiny_engine()
    e.update_params(params(0))
    yield e
    assert not e.pauser.paused
    e.update_params(params(0))


def start(eng, steps=K):
    """Queue PROMPTS, run `steps` steps; outputs seen so far."""
    for rid, p in PROMPTS.items():
        eng.add_request(rid, p, greedy())
    outs = {}
    for _ in range(steps):
        for o in eng.step():
            outs[o.request_id] = o
    for rid in PROMPTS:
        assert len(eng.scheduler.get_request(rid).output_token_ids) == steps
    return outs


def used(eng):
    """KV blocks held by requests (the prefix cache's free-but-cached ones excluded)."""
    return eng.scheduler.kv_cache_manager.num_used_blocks


def swap_in_flight(eng, mode):
    """From A, start PROMPTS, swap to B under `mode`, run to the end; final outputs."""
    eng.update_params(params(0))
    start(eng)
    v = eng.weight_version
    assert eng.update_params(params(1), in_flight=mode) == v + 1 == eng.weight_version
    return drain(eng), v


def test_abort_mode_fails_in_flight_with_old_tokens(eng):
    ref_a = reference(eng, 0, PROMPTS)
    outs, v = swap_in_flight(eng, "abort")
    for rid in PROMPTS:
        c = outs[rid].outputs[0]
        assert c.finish_reason == "error" and f"from version {v} to {v + 1}" in c.error
        assert c.token_ids == ref_a[rid][:K]
        assert c.token_weight_versions == [v] * K
    assert used(eng) == 0


def test_retract_mode_reruns_on_new_weights(eng):
    ref_a = reference(eng, 0, PROMPTS)
    # what B gives for prompt + the K tokens made under A
    cont = reference(eng, 1, {rid: p + ref_a[rid][:K] for rid, p in PROMPTS.items()}, N - K)
    outs, v = swap_in_flight(eng, "retract")
    for rid in PROMPTS:
        c = outs[rid].outputs[0]
        assert c.finish_reason == "length"
        assert c.token_ids == ref_a[rid][:K] + cont[rid]
        assert c.token_weight_versions == [v] * K + [v + 1] * (N - K)
    assert eng.scheduler.num_preemptions > 0 and used(eng) == 0


def test_keep_mode_goes_on_with_its_kv(eng):
    ref_a = reference(eng, 0, PROMPTS)
    ref_b = reference(eng, 1, PROMPTS)
    assert ref_a != ref_b
    # same weights under keep: nothing changes
    eng.update_params(params(0))
    start(eng)
    eng.update_params(params(0), in_flight="keep")
    outs = drain(eng)
    assert {rid: outs[rid].outputs[0].token_ids for rid in PROMPTS} == ref_a
    # the two halves by hand: K steps on A, then the runner's weights swapped under the
    # running requests (no engine bookkeeping: the keep pause only drops the step that
    # async scheduling dispatched ahead), the rest on B over A's KV
    eng.update_params(params(0))
    start(eng)
    eng.pause_generation("keep")
    eng.runner.update_params(params(1))
    eng.resume_generation()
    by_hand = {rid: o.outputs[0].token_ids for rid, o in drain(eng).items()}
    assert any(by_hand[rid][K:] != ref_a[rid][K:] for rid in PROMPTS)  # the swap shows
    # new weights under keep: exactly the hand-run tokens, switching at the boundary
    outs, v = swap_in_flight(eng, "keep")
    for rid in PROMPTS:
        c = outs[rid].outputs[0]
        assert c.finish_reason == "length" and len(c.token_ids) == N
        assert c.token_weight_versions == [v] * K + [v + 1] * (N - K)
        assert c.token_ids[:K] == ref_a[rid][:K] and c.token_ids == by_hand[rid]
    assert used(eng) == 0


def test_wait_mode_drains_and_admits_nobody(eng):
    ref_a = reference(eng, 0, PROMPTS)
    late = {"late": [3, 1, 4, 1, 5]}
    ref_late_b = reference(eng, 1, late)
    eng.update_params(params(0))
    start(eng)
    eng.add_request("late", late["late"], greedy())  # queued, not yet admitted
    eng.pause_generation("wait")  # runs the running three to the end on A
    assert eng.scheduler.num_running == 0
    assert eng.scheduler.get_request("late").output_token_ids == []  # never admitted
    finished = {o.request_id: o for o in eng.step()}  # their outputs; nothing scheduled
    assert set(finished) == set(PROMPTS)
    for rid in PROMPTS:
        assert finished[rid].outputs[0].token_ids == ref_a[rid]
    assert eng.step() == []
    eng.update_params(params(1))  # inside the pause: no mode applies
    eng.resume_generation()
    outs = drain(eng)
    assert outs["late"].outputs[0].token_ids == ref_late_b["late"]
    assert used(eng) == 0


def test_bad_calls_are_clear_errors(eng):
    with pytest.raises(ValueError, match="not paused"):
        eng.resume_generation()
    with pytest.raises(ValueError, match="unknown pause mode 'drop'"):
        eng.pause_generation("drop")
    with pytest.raises(ValueError, match="unknown pause mode 'x'"):
        eng.update_params(params(1), in_flight="x")
    eng.pause_generation("keep")
    with pytest.raises(ValueError, match="already paused"):
        eng.pause_generation("keep")
    assert eng.get_stats()["paused"] is True
    eng.resume_generation()
    assert eng.get_stats()["paused"] is False


def test_abort_older_than_ends_exactly_the_older(eng):
    ref_b = reference(eng, 1, PROMPTS)
    eng.update_params(params(0))
    start(eng)  # a, b, c start under version v
    v = eng.weight_version
    eng.update_params(params(1), in_flight="keep")
    eng.add_request("new", PROMPTS["a"], greedy())  # starts under v + 1
    assert sorted(eng.abort_older_than(v + 1)) == sorted(PROMPTS)
    assert eng.abort_older_than(v + 1) == []
    outs = drain(eng)
    assert set(outs) == {"new"}
    c = outs["new"].outputs[0]
    assert c.token_ids == ref_b["a"] and c.token_weight_versions == [v + 1] * N
    assert used(eng) == 0 and not eng.outputs.older_than(v + 2)

