"""The plan carries what the runner needs (issue 23): `NewRequestData` once per
(re)start of a request, the grammar bitmask as data, and a runner that keeps its
own copy of each running request in step with the scheduler's."""

import numpy as np

from jaxserve.scheduler.output import SchedulerOutput
from jaxserve.structured_output import GrammarDeadEnd
from jaxserve.worker.fake_runner import FakeRunner
from jaxserve.worker.runner import RowError, SampledToken

from ._util import expected_tokens, make_req, make_scheduler, prompt


def _new_ids(out: SchedulerOutput) -> list[str]:
    return [n.request_id for n in out.scheduled_new_reqs]


def test_new_request_data_once_per_start_and_again_after_preemption():
    s = make_scheduler(budget=64, max_seqs=4)
    a, b = make_req("a", prompt(10), max_tokens=8, temperature=0.7, seed=5), make_req("b", 6)
    s.add_request(a)
    s.add_request(b)
    fr = FakeRunner(s, check_invariants=True)
    first = fr.step().out
    assert _new_ids(first) == ["a", "b"]
    new_a = first.scheduled_new_reqs[0]
    assert new_a.prompt_token_ids == tuple(prompt(10)) and new_a.output_token_ids == ()
    assert new_a.seed == 5 and new_a.sampling_params is a.sampling_params
    assert _new_ids(fr.step().out) == []  # known to the runner now
    assert fr.requests["a"].output_token_ids == expected_tokens("a", 2)
    s.preempt("a")
    res = fr.step()
    assert res.out.preempted_ids == ("a",) and "a" not in fr.requests
    res = fr.step()  # "a" resumes: its kept outputs travel with it
    [resumed] = res.out.scheduled_new_reqs
    assert resumed.request_id == "a" and resumed.output_token_ids == tuple(expected_tokens("a", 2))
    while s.has_unfinished_requests():
        fr.step()
        for rid, st in fr.requests.items():  # the runner's copy agrees with the scheduler's
            live = s.get_request(rid)
            if live is not None:
                assert st.output_token_ids == live.output_token_ids, rid
    assert fr.finished["a"].output_token_ids == expected_tokens("a", 8)
    fr.execute(s.schedule())  # the next plan reports them finished: nothing is kept
    assert dict(fr.requests) == {}


def test_runner_copy_matches_scheduler_under_heavy_preemption():
    s = make_scheduler(budget=16, max_seqs=6, block_size=4, num_kv_blocks=14)
    for i in range(8):
        s.add_request(make_req(f"r{i}", 5 + i % 4, max_tokens=12 + i))
    checked = []

    def check(res):
        for sr in res.out.scheduled:
            live = s.get_request(sr.request_id)
            if live is not None:
                assert fr.requests[sr.request_id].output_token_ids == live.output_token_ids
                checked.append(sr.request_id)

    fr = FakeRunner(s, check_invariants=True, on_step=check)
    done = fr.run()
    assert s.num_preemptions > 0 and checked
    for i in range(8):
        assert done[f"r{i}"].output_token_ids == expected_tokens(f"r{i}", 12 + i)


def test_runner_fails_a_row_it_has_no_state_for_and_cuts_back_extra_outputs():
    s = make_scheduler()
    s.add_request(make_req("a", 5, max_tokens=4))
    out = s.schedule()
    fr = FakeRunner(vocab_size=None)
    bare = SchedulerOutput(out.scheduled, out.num_scheduled_tokens, out.token_bucket,
                           out.seq_bucket, (), (), out.step)  # no NewRequestData
    res = fr.execute(bare)
    assert isinstance(res["a"], RowError) and "not among the runner's requests" in res["a"].message
    assert isinstance(fr.execute(out)["a"], SampledToken)
    assert fr.requests["a"].output_token_ids == expected_tokens("a", 1)
    fr.execute(out)  # the same plan again (the engine kept no token): output 0 again
    assert fr.requests["a"].output_token_ids == expected_tokens("a", 1)


class _Allow:
    """A stand-in grammar matcher over V = 64 that allows `ids` (none: a dead end)."""

    bitmask_words = 2

    def __init__(self, *ids):
        self.ids = ids

    def fill_bitmask(self, row):
        for t in self.ids:
            row[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
        if not self.ids:
            raise GrammarDeadEnd("no token can continue")


def test_grammar_bitmask_travels_in_the_plan_and_a_dead_end_fails_its_row_alone():
    s = make_scheduler(budget=8, block_size=4)
    g, dead, free = make_req("g", 10, max_tokens=3), make_req("d", 3), make_req("f", 3)
    g.grammar, dead.grammar = _Allow(40, 33), _Allow()
    for r in (g, dead, free):
        s.add_request(r)
    fr = FakeRunner(s, vocab_size=64, token_fn=lambda req, pos: 35)
    res = fr.step()  # "g" prefills 8 of 10 tokens: it samples nothing, so has no mask row
    assert res.out.grammar is None and [sr.request_id for sr in res.out.scheduled] == ["g"]
    res = fr.step()
    grammar = res.out.grammar
    assert grammar.request_ids == ("g", "d")
    want = np.zeros(2, np.int32)
    want[1] = (1 << 1) | (1 << 8)  # ids 33 and 40
    np.testing.assert_array_equal(grammar.bitmask[0], want)
    assert grammar.errors == {"d": "GrammarDeadEnd: no token can continue"}
    assert res.sampled["g"] == 40  # the scripted 35 is masked out: the next allowed id
    assert fr.finished["d"].finish_reason == "error"
    assert res.sampled["f"] == 35  # the unconstrained row is untouched


def test_restore_waiting_puts_preempted_first_and_newcomers_after_the_held():
    """A "wait" pause sets the queue aside; on resume the requests preempted meanwhile
    go first, then the held ones, then those added during the pause (arrival order)."""
    s = make_scheduler(budget=64, max_seqs=1)
    s.add_request(make_req("run", 4))
    s.add_request(make_req("held", 4))
    fr = FakeRunner(s)
    fr.step()  # "run" is running; "held" waits (max_seqs=1)
    held = s.set_aside_waiting()
    s.add_request(make_req("new", 4))  # arrives during the pause
    assert s.retract_running() == ["run"]
    s.restore_waiting(held)
    assert [r.request_id for r in s.waiting] == ["run", "held", "new"]
