"""The runner's persistent block table (issue 24): a step laid out from the slot-indexed
table the runner keeps (`RequestStates.block_table`, updated by new blocks only) equals
the same step laid out from every row's block ids in the plan, under preemption, prefix
hits, aborts, finishes and slot reuse."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxserve.scheduler.request import RequestStatus
from jaxserve.worker.fake_runner import FakeRunner
from jaxserve.worker.input_batch import RequestStates, build_batch

from tests.scheduler._util import assert_pool_clean, make_req, make_scheduler

B = 4


def _check_against_stateless(steps, P):
    laid = 0
    for st in steps:
        if not st.out.scheduled:
            continue
        ref = build_batch(st.out, block_size=B, max_blocks_per_seq=P)
        for f in dataclasses.fields(ref):
            np.testing.assert_array_equal(getattr(st.batch, f.name), getattr(ref, f.name),
                                          err_msg=f"{f.name} at step {st.out.step}")
        laid += 1
    return laid


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_persistent_table_equals_the_plans_block_ids(seed):
    rng = np.random.default_rng(seed)
    # A pool small enough to preempt, prefix caching on (shared prompt heads), 20 slots'
    # worth of requests through 5 rows so slots are reused and the table doubles.
    s = make_scheduler(budget=24, max_seqs=5, block_size=B, num_kv_blocks=24, threshold=8)
    head = list(range(20, 32))
    for i in range(20):
        tail = [int(x) for x in rng.integers(40, 900, int(rng.integers(1, 14)))]
        s.add_request(make_req(f"r{i}", head + tail if i % 2 else tail,
                               max_tokens=int(rng.integers(1, 60))))
    steps = []
    runner = FakeRunner(s, build_batches=True, on_step=steps.append)
    aborted = 0

    def abort_some(result):  # abort a running request now and then (its slot freed)
        nonlocal aborted
        steps.append(result)
        if result.out.step % 11 == 3 and s.num_running:
            rid = next(iter(r.request_id for r in s.running))
            s.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
            aborted += 1
    runner.on_step = abort_some
    runner.run()
    assert _check_against_stateless(steps, s.max_blocks_per_seq) > 20
    assert aborted and any(st.out.preempted_ids for st in steps)  # both paths exercised
    runner.step()  # an empty plan: it carries the last finished ids to the runner
    assert not runner.requests and np.all(runner.requests.block_table == 0)
    assert_pool_clean(s)


def test_table_grows_reuses_slots_and_rewrites_a_changed_row():
    states = RequestStates(max_blocks_per_seq=3)
    assert states.block_table.shape == (16, 3)
    from jaxserve.worker.input_batch import CachedRequestState

    class New:  # the NewRequestData fields CachedRequestState reads
        prompt_token_ids, sampling_params, seed, eos_token_ids = (1,), None, 0, ()
        logprob_start, output_token_ids, lora_slot = None, (), 0

    sts = []
    for i in range(20):  # more than 15 slots: the table doubles
        new = New()
        new.request_id = f"r{i}"
        st = states[new.request_id] = CachedRequestState(new)
        states._sync_blocks(st, [i + 1])
        sts.append(st)
    assert states.block_table.shape == (32, 3)
    assert sorted(st.slot for st in sts) == list(range(1, 21))
    assert [int(states.block_table[st.slot, 0]) for st in sts] == list(range(1, 21))
    st = sts[4]
    states._sync_blocks(st, [5, 9])  # an extension: the tail is written
    states._sync_blocks(st, [7, 8])  # not an extension of [5, 9]: the row is rewritten
    assert states.block_table[st.slot].tolist() == [7, 8, 0]
    states._sync_blocks(st, [7, 8, 6, 2])  # longer than P: clipped (build_batch rejects it)
    assert states.block_table[st.slot].tolist() == [7, 8, 6]
    slot = st.slot
    states._drop("r4")
    assert not states.block_table[slot].any() and "r4" not in states
    assert states._slot() == slot  # reused
    assert states.block_table[0].tolist() == [0, 0, 0]
