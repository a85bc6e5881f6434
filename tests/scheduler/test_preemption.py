"""Preemption by recompute (C04, C05): forced at chosen moments, the resumed run
feeds positions 0..num_tokens-1 exactly once, samples nothing before the end,
and the output equals the unpreempted run token for token."""

import numpy as np
import pytest

from jaxserve.scheduler.request import RequestStatus
from jaxserve.worker.fake_runner import FakeRunner

from ._util import assert_pool_clean, expected_tokens, make_req, make_scheduler, prompt

P, MAX = 7, 40


def _rows(steps, rid):
    return [(st, r) for st in steps for r in st.out.scheduled if r.request_id == rid]


def _run_with_forced_preemptions(moments, *, prompt_len=P, budget=32, prefix=False, companions=1):
    """Preempt request "r" whenever the predicate moment(request, step_index) fires."""
    s = make_scheduler(budget=budget, max_seqs=4, block_size=4, num_kv_blocks=60, prefix=prefix)
    s.add_request(make_req("r", prompt_len, max_tokens=MAX))
    for i in range(companions):
        s.add_request(make_req(f"c{i}", 5, max_tokens=MAX))
    steps = []
    fr = FakeRunner(s, build_batches=True, check_invariants=True, on_step=steps.append)
    snapshots = []  # (num_tokens, num_outputs) of r at each forced preemption
    pending = list(moments)
    while s.has_unfinished_requests():
        fr.step()
        r = s.get_request("r")
        if r is not None and pending and r.status == RequestStatus.RUNNING and pending[0](r):
            pending.pop(0)
            assert s.preempt("r")
            snapshots.append((r.num_tokens, r.num_output_tokens, len(steps)))
    assert not pending, "a preemption moment never happened"
    return s, steps, fr.finished, snapshots


def _check_resume(steps, snapshots, finished, prefix):
    r_final = finished["r"]
    assert r_final.output_token_ids == expected_tokens("r", MAX)  # no loss, no duplicate
    assert r_final.num_preemptions == len(snapshots) and r_final.finish_reason == "length"
    rows = _rows(steps, "r")
    for num_tokens, num_out, at_step in snapshots:
        # The step right after the hook preempts r and admits nobody.
        assert "r" in steps[at_step].out.preempted_ids
        assert all(x.request_id != "r" for x in steps[at_step].out.scheduled)
        resumed = [(st, x) for st, x in rows if steps.index(st) > at_step]
        fed, k = [], 0
        while True:  # rows of the recompute, up to and including the first sampled one
            st, x = resumed[k]
            fed.append((st, x))
            k += 1
            if x.sample:
                break
        first = fed[0][1].start_pos
        if prefix:
            assert first % 4 == 0 and first < num_tokens
        else:
            assert first == 0
        positions = []
        for st, x in fed:
            i = [y.request_id for y in st.out.scheduled].index("r")
            lo, hi = st.batch.query_start_loc[i], st.batch.query_start_loc[i + 1]
            positions.extend(st.batch.positions[lo:hi].tolist())
            assert list(x.token_ids) == r_final.all_token_ids[x.start_pos:x.end_pos]
        # Positions run first..num_tokens-1 exactly once, strictly increasing, no gaps.
        assert positions == list(range(first, num_tokens))
        assert [x.sample for _, x in fed] == [False] * (len(fed) - 1) + [True]
        assert fed[-1][1].output_pos == num_out  # the next token gets the next index


def _outputs(n):
    return lambda r: r.num_output_tokens == n


MOMENTS = {
    "first_token_computed_eq_prompt": [_outputs(1)],  # computed == prompt_len, 1 output
    "right_after_first_token_fed": [_outputs(2)],
    "many_outputs_recompute_gt_2x_prompt": [_outputs(30)],  # 7 + 30 > 2 * 7
    "twice": [_outputs(5), _outputs(20)],
    "again_right_after_resuming": [_outputs(3), _outputs(4)],
}


@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("name", list(MOMENTS))
def test_forced_preemption_moments(name, prefix):
    s, steps, done, snaps = _run_with_forced_preemptions(MOMENTS[name], prefix=prefix)
    _check_resume(steps, snaps, done, prefix)
    for i in range(1):
        assert done[f"c{i}"].output_token_ids == expected_tokens(f"c{i}", MAX)
    assert_pool_clean(s)


@pytest.mark.parametrize("prefix", [False, True])
def test_preempt_mid_chunked_prefill(prefix):
    # Prompt 30 with budget 8: preempt after two 8-token chunks (16 computed, no output).
    mid = [lambda r: r.num_computed_tokens == 16 and r.num_output_tokens == 0]
    s, steps, done, snaps = _run_with_forced_preemptions(mid, prompt_len=30, budget=8,
                                                         prefix=prefix, companions=0)
    assert snaps[0][:2] == (30, 0)
    _check_resume(steps, snaps, done, prefix)
    rows = _rows(steps, "r")
    assert not any(x.sample for _, x in rows[:2])  # nothing sampled from a non-final chunk
    if prefix:  # the two committed chunks (4 full blocks) are reused
        resumed = [x for st, x in rows if steps.index(st) > snaps[0][2]]
        assert resumed[0].start_pos == 16
    assert_pool_clean(s)


def test_preempt_hook_on_waiting_and_unknown():
    s = make_scheduler()
    s.add_request(make_req("w", 5))
    assert s.preempt("w") is False  # not running yet: a no-op unless it runs by then
    with pytest.raises(ValueError, match="unknown or finished request_id='nope'"):
        s.preempt("nope")


@pytest.mark.parametrize("prefix", [False, True])
def test_siblings_n3_under_pool_pressure(prefix):
    # C04 variant: three samples of one prompt (the engine makes one Request each).
    s = make_scheduler(budget=64, max_seqs=8, block_size=4, num_kv_blocks=40, prefix=prefix)
    shared = prompt(21, 5)
    for i in range(3):
        s.add_request(make_req(f"p#{i}", shared, max_tokens=64))
    for i in range(3):
        s.add_request(make_req(f"q{i}", 10 + 9 * i, max_tokens=64))
    steps = []
    done = FakeRunner(s, check_invariants=True, on_step=steps.append).run()
    assert s.num_preemptions > 0
    for rid, r in done.items():
        assert r.output_token_ids == expected_tokens(rid, 64)
        assert len(r.output_token_ids) == 64 and r.finish_reason == "length"
    # Each request's fed positions, between preemptions, never skip or repeat.
    for rid in done:
        nxt = None  # None: (re)admission, which starts at 0 or at a prefix-cache hit
        for st in steps:
            if rid in st.out.preempted_ids:
                nxt = None
            for x in st.out.scheduled:
                if x.request_id == rid:
                    if nxt is None:
                        assert x.start_pos % 4 == 0 and (prefix or x.start_pos == 0)
                    else:
                        assert x.start_pos == nxt
                    nxt = x.end_pos
    assert_pool_clean(s)
    np.testing.assert_equal(s.kv_cache_manager.usage, 0.0)
