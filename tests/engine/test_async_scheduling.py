"""Async scheduling (issue 24): the same workloads with `async_scheduling` on and off give
exactly the same outputs.

With it on, `step()` plans and dispatches step n+1 as soon as step n's tokens are back,
then processes step n's outputs while n+1 runs; a stop string found then ends its request
after its next row was dispatched (that row is dropped), and a pause, a sleep or a weight
swap drops the step in flight (`Scheduler.unschedule`). The reference is the serial loop
(plan, run, fetch, process, one after another), the same engine class with the flag off.
Over the FakeRunner (hand-checkable tokens keyed on request and position): random
interleavings of add / abort / step with stop strings, stop ids, min_tokens, n>1, seeds,
prefix caching and rows that fail alone; a whole step that fails; structured output. Over
the real tiny model: greedy and seeded sampling with stop strings, n=2 and logprobs; a
weight update between steps under "keep" and "abort"."""

from __future__ import annotations

import os
import re
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import drain, tiny_engine, tiny_params, tiny_tokenizer
from jaxserve.config import ModelConfig
from jaxserve.engine import LLMEngine, make_engine_config
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.fake_runner import FakeRunner, counting_token, default_token

PROMPTS = ["abcd", "abcdefgh", "xyz", "abcdabcd", "hello world", "q"]


def _h(*key) -> int:
    return zlib.crc32(":".join(map(str, key)).encode())


def fake_engine(on: bool, *, pool: int = 40, seqs: int = 4, budget: int = 16,
                prefix: bool = True, fail_rows: bool = False, fail_steps: bool = False,
                step_delay: float = 0.0) -> LLMEngine:
    model = ModelConfig.tiny()
    config = make_engine_config(model, max_model_len=32, block_size=4, num_kv_blocks=pool,
                                max_num_seqs=seqs, max_num_batched_tokens=budget,
                                enable_prefix_caching=prefix, async_scheduling=on)

    def row_fails(req) -> bool:  # keyed on the request's own progress: batch-independent
        return fail_rows and _h(req.request_id, req.num_output_tokens) % 17 == 0

    def step_fails(req) -> bool:
        return fail_steps and _h(req.request_id, req.num_computed_tokens) % 29 == 0

    runner = FakeRunner.for_config(config, token_fn=counting_token(model.vocab_size, 2),
                                   fail_row=row_fails, fail_step=step_fails,
                                   step_delay=step_delay)
    return LLMEngine(config, tokenizer=tiny_tokenizer(), runner=runner, warmup=False)


def final(o) -> list[tuple]:
    return [(c.index, list(c.token_ids), c.text, c.finish_reason, c.stop_reason, c.error,
             round(c.cumulative_logprob, 6), c.logprobs and list(c.logprobs)) for c in o.outputs]


def run_ops(eng: LLMEngine, ops, *, tag: str = "r", final=final, steps: list | None = None,
            kv_free=None) -> tuple[dict, dict]:
    """Apply ops; returns (request_id -> final outputs, aborted id -> token ids seen).
    `steps` (a list) gets every output as (id, tokens per sample, text per sample);
    `kv_free(eng)`: whether no KV block is held (default: the engine's own manager)."""
    added, finals, seen, aborted = [], {}, {}, {}

    def take(outs):
        for o in outs:
            seen[o.request_id] = [list(c.token_ids) for c in o.outputs]
            if steps is not None:
                steps.append((o.request_id, seen[o.request_id], [c.text for c in o.outputs]))
            if o.finished:
                assert o.request_id not in finals, o.request_id
                finals[o.request_id] = final(o)

    for op in ops:
        if op[0] == "add":
            rid = f"{tag}{len(added)}"
            try:
                eng.add_request(rid, op[1], op[2])
            except ValueError as e:
                assert "KV blocks" in str(e), e
                continue
            added.append(rid)
        elif op[0] == "abort" and added:
            rid = added[op[1] % len(added)]
            if rid not in finals and eng.abort(rid):
                aborted[rid] = seen.get(rid, [])
        elif op[0] == "step":
            for _ in range(op[1]):
                take(eng.step())
        elif op[0] == "update":  # (a runner whose update_params takes None)
            eng.call(_keep_update) if hasattr(eng, "call") else _keep_update(eng)
    for _ in range(3000):
        if not eng.has_unfinished_requests():
            break
        take(eng.step())
    assert not eng.has_unfinished_requests()
    assert set(finals) == set(added) - set(aborted)
    assert (kv_free or _kv_free)(eng)  # nothing leaked, on or off
    return finals, aborted


def _keep_update(eng) -> None:
    eng.update_params(None, in_flight="keep")


def _kv_free(eng) -> bool:
    kv = eng.scheduler.kv_cache_manager
    return kv.num_free_blocks == kv.num_blocks


def _prefix_of(a: list, b: list) -> bool:
    return len(a) <= len(b) and b[:len(a)] == a


_params = st.builds(
    lambda n, mt, greedy, seed, stop, stop_id, min_t, lp: SamplingParams(
        n=n, max_tokens=mt, temperature=0.0 if greedy else 1.0, seed=seed,
        stop=(stop,) if stop else (), stop_token_ids=(stop_id,) if stop_id else (),
        min_tokens=min(min_t, mt), logprobs=lp),
    n=st.integers(1, 3), mt=st.integers(1, 14), greedy=st.booleans(), seed=st.integers(0, 99),
    stop=st.sampled_from([None, None, "g", "hi", "D", "ef"]),
    stop_id=st.sampled_from([None, None, 9, 2]), min_t=st.integers(0, 3),
    lp=st.sampled_from([None, 0, 2]))
_op = st.one_of(
    st.tuples(st.just("add"), st.sampled_from(PROMPTS), _params),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("step"), st.integers(1, 3)),
)


@settings(max_examples=int(os.environ.get("JAXSERVE_PROPERTY_EXAMPLES", "40")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_op, min_size=1, max_size=30), pool=st.integers(12, 40),
       seqs=st.sampled_from([1, 2, 4]), budget=st.sampled_from([8, 16]),
       fail_rows=st.booleans(), prefix=st.booleans())
def test_random_interleavings_give_the_same_outputs_on_and_off(ops, pool, seqs, budget,
                                                                 fail_rows, prefix):
    kw = dict(pool=pool, seqs=seqs, budget=budget, prefix=prefix, fail_rows=fail_rows)
    f_on, ab_on = run_ops(fake_engine(True, **kw), ops)
    f_off, ab_off = run_ops(fake_engine(False, **kw), ops)
    # An abort lands between the same two step() calls, but not at the same progress: with
    # async scheduling on, a request added (or given a seat a stop string freed) meanwhile
    # starts one step later, since the next step was already dispatched. So a request may
    # finish in one run and be aborted in the other; what the aborted one had shown is then
    # a prefix of the other's tokens. Every request both runs finished is identical.
    both = f_on.keys() & f_off.keys()
    assert {r: f_on[r] for r in both} == {r: f_off[r] for r in both}
    assert f_on.keys() - both <= ab_off.keys() and f_off.keys() - both <= ab_on.keys()
    for fin, ab in ((f_on, ab_off), (f_off, ab_on)):
        for rid in ab.keys() & fin.keys():
            for seen, c in zip(ab[rid], fin[rid]):
                assert _prefix_of(seen, c[1]), (rid, seen, c[1])
    for rid in ab_on.keys() & ab_off.keys():
        for a, b in zip(ab_on[rid], ab_off[rid]):
            assert _prefix_of(a, b) or _prefix_of(b, a), (rid, a, b)


def test_whole_step_failures_and_stop_strings_same_on_and_off():
    """Rows that fail alone and stop strings that end requests while their next row is in
    flight: the same outputs on and off. Steps that fail as a whole (retried once by
    recompute, then "error"): which rows share a failing step depends on the plans (planned
    ahead, a request that ends by EOS or a stop string frees its seat a step later), so
    each run is checked against the run without them: a sample a step failure ended holds
    a prefix of its tokens, every other sample ends exactly as there."""
    sp = [SamplingParams(max_tokens=12, temperature=1.0, seed=s, stop=("hi", "D")[s % 2:][:1],
                         n=1 + s % 2) for s in range(6)]
    ops = [("add", PROMPTS[i % len(PROMPTS)], sp[i]) for i in range(6)]
    clean, _ = run_ops(fake_engine(True, fail_rows=True, seqs=4), ops)
    assert clean == run_ops(fake_engine(False, fail_rows=True, seqs=4), ops)[0]
    step_errors = 0
    for on in (True, False):
        got, _ = run_ops(fake_engine(on, fail_rows=True, fail_steps=True, seqs=4), ops)
        assert got.keys() == clean.keys()
        for rid, outs in got.items():
            for c, ref in zip(outs, clean[rid], strict=True):
                if c[3] == "error" and c[5].startswith("RuntimeError: scripted step"):
                    step_errors += 1
                    assert _prefix_of(c[1], ref[1]), (rid, c, ref)
                else:
                    assert c == ref, (rid, c, ref)
    assert step_errors >= 2  # a step failure ended a sample in each run
    reasons = {c[3] for outs in clean.values() for c in outs}
    assert "error" in reasons and "length" in reasons, reasons  # a row failure too


def test_next_step_is_dispatched_before_this_steps_outputs_are_processed():
    """The order of the host's calls (not a timing): with async scheduling the runner
    gets step n+1 before step n's tokens reach the output processor, so the device runs
    it meanwhile; serial, each step's outputs are processed before the next is planned.
    With a simulated device the step's wait shows in `device_wait_s` either way."""
    calls = {}
    for on in (True, False):
        eng = fake_engine(on, seqs=4, budget=16, step_delay=0.001)
        log = calls[on] = []
        dispatch, process = eng.runner.dispatch, eng.outputs.process_tokens

        def logged_dispatch(out, dispatch=dispatch, log=log):
            log.append(("dispatch", out.step))
            return dispatch(out)

        def logged_process(sampled, now, process=process, log=log):
            log.append(("process", len(sampled)))
            return process(sampled, now)

        eng.runner.dispatch, eng.outputs.process_tokens = logged_dispatch, logged_process
        ops = [("add", p, SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0))
               for p in PROMPTS[:4]]
        run_ops(eng, ops)
        assert eng.runner.device_busy_s > 0 and eng.runner.device_wait_s > 0
    kinds = {on: [k for k, _ in log] for on, log in calls.items()}
    # serial: dispatch, process, dispatch, process, ...
    assert kinds[False][:4] == ["dispatch", "process", "dispatch", "process"], kinds[False]
    # async: the second dispatch comes before the first processing
    assert kinds[True][:3] == ["dispatch", "dispatch", "process"], kinds[True]
    assert kinds[True].count("process") == kinds[False].count("process")


class _Pending:
    """A dispatched step's handle that logs its fetch, or fails it (a device error)."""

    def __init__(self, handle, log, step, fail=False):
        self.handle, self.log, self.step, self.fail = handle, log, step, fail

    def result(self):
        self.log.append(("result", self.step))
        if self.fail:
            raise RuntimeError("scripted device failure")
        return self.handle.result()


def test_decode_rows_are_planned_before_the_step_before_is_fetched():
    """With placeholders the runner gets plan n+1 before step n is fetched, its decode row
    reading `PLACEHOLDER_TOKEN_ID` (laid out as such; the device fills it in); a request
    with penalties is planned only after the fetch. Both match the serial loop."""
    from jaxserve.scheduler.output import PLACEHOLDER_TOKEN_ID

    logs, res = {}, {}
    for pen, on in ((0.0, True), (1.5, True), (0.0, False)):
        eng = fake_engine(on)
        eng.runner.build_batches = True
        log = logs[pen, on] = []
        dispatch = eng.runner.dispatch

        def logged(out, dispatch=dispatch, log=log, eng=eng):
            h = dispatch(out)
            ph = bool(out.scheduled) and PLACEHOLDER_TOKEN_ID in eng.runner.last_batch.input_ids
            assert ph == any(PLACEHOLDER_TOKEN_ID in sr.token_ids for sr in out.scheduled)
            log.append(("dispatch", out.step, ph))
            return _Pending(h, log, out.step)

        eng.runner.dispatch = logged
        sp = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0,
                            presence_penalty=pen)
        res[pen, on] = run_ops(eng, [("add", "abcd", sp)])[0]
    assert logs[0.0, True][:6] == [("dispatch", 1, False), ("dispatch", 2, True), ("result", 1),
                                   ("dispatch", 3, True), ("result", 2), ("dispatch", 4, True)]
    assert logs[1.5, True][:4] == [("dispatch", 1, False), ("result", 1), ("dispatch", 2, False),
                                   ("result", 2)]
    assert res[0.0, True] == res[1.5, True] == res[0.0, False]  # the fake ignores penalties
    assert res[0.0, True]["r0"][0][1] == [8, 9, 10, 11]  # counts up from "d" (hand-checked)


def test_a_step_failing_on_the_device_drops_the_step_planned_after_it():
    """Step n fails when fetched while n+1 (reading its tokens) is in flight: n+1 is
    waited for and taken back, n's rows are retried by recompute; outputs as serial."""
    res = {}
    for on in (True, False):
        eng = fake_engine(on, prefix=False)
        log, dispatch = [], eng.runner.dispatch

        def failing(out, dispatch=dispatch, log=log):
            fail = not log and any(sr.request_id == "r1" and sr.output_pos == 3
                                   for sr in out.scheduled)
            if fail:
                log.append(out.step)
            return _Pending(dispatch(out), [], out.step, fail)

        eng.runner.dispatch = failing
        ops = [("add", p, SamplingParams(max_tokens=7, temperature=0.0)) for p in PROMPTS[:3]]
        res[on], _ = run_ops(eng, ops)
        assert log and eng.num_failed_steps == 1
        assert eng.scheduler.get_request("r1") is None  # finished, nothing held
    assert res[True] == res[False]
    assert all(c[3] == "length" for outs in res[True].values() for c in outs)


def test_a_plan_made_ahead_that_fails_to_dispatch_is_planned_again():
    """The runner refuses plans with placeholders twice: each is taken back once the step
    before is applied and planned again after the fetch; nothing fails, outputs as serial."""
    from jaxserve.scheduler.output import PLACEHOLDER_TOKEN_ID

    res = {}
    for on in (True, False):
        eng = fake_engine(on)
        refused, dispatch = [], eng.runner.dispatch

        def refusing(out, dispatch=dispatch, refused=refused):
            if len(refused) < 2 and any(PLACEHOLDER_TOKEN_ID in sr.token_ids
                                        for sr in out.scheduled):
                refused.append(out.step)
                raise RuntimeError("no placeholders here")
            return dispatch(out)

        eng.runner.dispatch = refusing
        ops = [("add", p, SamplingParams(max_tokens=6, temperature=0.0)) for p in PROMPTS[:3]]
        res[on], _ = run_ops(eng, ops)
        assert len(refused) == (2 if on else 0) and eng.num_failed_steps == 0
    assert res[True] == res[False]


def test_planning_ahead_that_raises_keeps_the_step_in_flight():
    """`schedule(ahead=True)` raising (a scheduler bug, every time) propagates out of
    `step()` with the step in flight kept; the next `step()` applies that step alone (never
    wedged); after aborts no KV block is held and the next request gets a fresh engine's
    output."""
    eng = fake_engine(True, prefix=False)
    sp = SamplingParams(max_tokens=6, temperature=0.0)
    for i, p in enumerate(PROMPTS[:3]):
        eng.add_request(f"r{i}", p, sp)
    schedule, raised = eng.scheduler.schedule, []

    def flaky(*a, ahead=False, **kw):
        if ahead and (raised or eng.scheduler.get_request("r0").num_output_tokens >= 2):
            raised.append(1)
            raise RuntimeError("scheduler bug")
        return schedule(*a, ahead=ahead, **kw)

    eng.scheduler.schedule = flaky
    with pytest.raises(RuntimeError, match="scheduler bug"):
        for _ in range(50):
            eng.step()
    assert raised and eng._inflight is not None  # the step in flight is not lost
    before = eng.scheduler.get_request("r0").num_output_tokens
    eng.step()  # applied alone (no second try at planning ahead first): never wedged
    assert eng._inflight is None and eng.scheduler.get_request("r0").num_output_tokens > before
    eng.scheduler.schedule = schedule
    for i in range(3):
        eng.abort(f"r{i}")
    while eng.has_unfinished_requests() or eng._inflight is not None:
        eng.step()
    kv = eng.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks and not eng.scheduler.requests
    kv.check_invariants([])
    eng.add_request("again", PROMPTS[3], sp)
    got = final(drain(eng)["again"])
    ref = fake_engine(True, prefix=False)
    ref.add_request("again", PROMPTS[3], sp)
    assert got == final(drain(ref)["again"]) and got[0][3] == "length"


def test_structured_output_steps_same_on_and_off():
    """Grammar rows run without overlap (their next mask needs this token accepted);
    the plain rows beside them and the grammar outputs match the serial loop's."""
    from test_structured_output import MODEL_VOCAB, SCHEMAS, ascii_tokenizer

    outs = {}
    for on in (True, False):
        model = ModelConfig.tiny(vocab_size=MODEL_VOCAB, max_position_embeddings=512)
        config = make_engine_config(model, max_model_len=128, block_size=4, num_kv_blocks=200,
                                    max_num_seqs=4, max_num_batched_tokens=32,
                                    async_scheduling=on)
        runner = FakeRunner.for_config(
            config, token_fn=lambda r, pos: default_token(r.request_id, pos, vocab_size=98))
        eng = LLMEngine(config, tokenizer=ascii_tokenizer(), runner=runner)
        ops = [("add", "go", SamplingParams(max_tokens=60, structured_outputs={"json": SCHEMAS[0]})),
               ("add", "hey", SamplingParams(max_tokens=20, stop=("k",)))]
        ops += [("step", 3), ("add", "more", SamplingParams(max_tokens=10))]
        outs[on], _ = run_ops(eng, ops)
    assert outs[True] == outs[False]
    assert outs[True]["r0"][0][3] == "stop"  # the grammar completed


def assert_same(a: dict, b: dict) -> None:
    """Tokens, text, finish and stop reasons, errors exactly; logprobs to 1e-5: a stop
    string's dropped row can change a step's bucket shape, and XLA:CPU's float sums
    with it (the sampled tokens are batch-invariant, the logprobs' last bits are not)."""
    assert a.keys() == b.keys()
    for rid in a:
        for x, y in zip(a[rid], b[rid], strict=True):
            if isinstance(x, list):  # token_weight_versions
                assert x == y, (rid, x, y)
                continue
            assert x[:6] == y[:6] and x[8:] == y[8:], (rid, x, y)
            assert abs(x[6] - y[6]) < 1e-4, (rid, x[6], y[6])
            if x[7] is not None:
                for ex, ey in zip(x[7], y[7], strict=True):
                    assert ex.keys() == ey.keys(), (rid, ex, ey)
                    np.testing.assert_allclose([ex[k] for k in ex], [ey[k] for k in ex],
                                               atol=1e-5)


def _tiny_workload():
    return [("g", "the quick brown", SamplingParams(temperature=0.0, max_tokens=20)),
            ("s", "hello there", SamplingParams(temperature=0.9, seed=7, max_tokens=24,
                                                n=2, logprobs=2)),
            ("t", "abc", SamplingParams(temperature=0.0, max_tokens=30, stop=("e",))),
            ("u", "zz top", SamplingParams(temperature=1.0, seed=3, max_tokens=16,
                                           stop=("a", "o")))]


def test_real_tiny_model_same_tokens_logprobs_and_text_on_and_off():
    """On, decode rows read step n's tokens on the device (placeholders), except while the
    penalised request runs (its penalties read its outputs on the host)."""
    eng = tiny_engine()
    res, merged = {}, {}
    feed = eng.runner.feed
    sources = feed.sources
    pen = SamplingParams(temperature=0.0, max_tokens=6, repetition_penalty=1.3,
                         presence_penalty=0.5)
    assert eng.runner.placeholders is False  # off by default on CPU (`async_placeholders`)
    eng.runner.placeholders = True
    try:
        for on in (True, False):
            eng.async_scheduling = on
            log = merged[on] = []
            feed.sources = lambda *a, log=log: log.append(sources(*a)) or log[-1]
            res[on], _ = run_ops(eng, [("add", p, sp) for _, p, sp in _tiny_workload()]
                                 + [("add", "penalised", pen)])
    finally:
        eng.async_scheduling = eng.config.async_scheduling
        eng.runner.placeholders = False
        del feed.sources
    assert_same(res[True], res[False])
    assert any(c[3] == "stop" for outs in res[True].values() for c in outs)  # a stop string hit
    assert eng.get_stats()["num_compiles_after_warmup"] == 0
    assert sum(src is not None for src in merged[True]) > 10  # steps planned ahead ran
    assert all(src is None for src in merged[False])
    assert any(src is None for src in merged[True][1:6])  # not while "penalised" ran


def test_weight_update_between_steps_same_on_and_off():
    """update_params after K step() calls: under "keep" the requests go on over their KV
    on the new weights from the same token; under "abort" they fail with the same tokens.
    The step async scheduling had dispatched ahead is dropped, not kept."""
    eng = tiny_engine()
    _, p0 = tiny_params()
    _, p1 = tiny_params(seed=1)
    res = {}
    eng.runner.placeholders = True  # off by default on CPU (`async_placeholders`)
    try:
        for mode in ("keep", "abort"):
            for on in (True, False):
                eng.async_scheduling = on
                for rid, prompt, sp in _tiny_workload():
                    eng.add_request(rid, prompt, sp)
                seen = {}
                for _ in range(4):
                    for o in eng.step():
                        seen[o.request_id] = o
                eng.update_params(p1, in_flight=mode)
                for _ in range(3000):
                    if not eng.has_unfinished_requests():
                        break
                    for o in eng.step():
                        seen[o.request_id] = o
                v0 = eng.weight_version - 1  # the version the requests started on
                res[mode, on] = {  # the versions named in the errors differ by run
                    rid: [c[:5] + (c[5] and re.sub(r"\d+", "N", c[5]),) + c[6:] for c in final(o)]
                    + [[v - v0 for v in o.outputs[0].token_weight_versions]]
                    for rid, o in seen.items()}
                eng.update_params(p0)
    finally:
        eng.async_scheduling = eng.config.async_scheduling
        eng.runner.placeholders = False
    for mode in ("keep", "abort"):
        assert_same(res[mode, True], res[mode, False])
    assert any(c[3] == "error" for outs in res["abort", True].values() for c in outs[:-1])
    assert {v for outs in res["keep", True].values() for v in outs[-1]} == {0, 1}  # both weights


def test_pause_gives_back_what_the_dropped_step_admitted():
    """Plan n+1 may admit a waiting request before a pause drops it: that request goes back
    to the waiting queue (blocks freed), so a "wait" pause drains exactly the requests
    serial steps would have been running, and the outputs match."""
    res = {}
    for on in (True, False):
        eng = fake_engine(on, seqs=2)
        g = lambda n: SamplingParams(max_tokens=n, temperature=0.0)  # noqa: E731
        eng.add_request("A", "abcd", g(8))
        eng.add_request("B", "xyz", g(2))  # ends by length on the second step
        eng.add_request("W", "q", g(3))  # waits for B's seat
        eng.step(), eng.step()
        eng.pause_generation("wait")
        during = sorted(o.request_id for o in eng._pending if o.finished)
        w = eng.scheduler.get_request("W")
        assert w is not None and w.status.name == "WAITING" and w.num_computed_tokens == 0
        eng.resume_generation()
        res[on] = during, {rid: final(o) for rid, o in drain(eng).items()}
    assert res[True][0] == res[False][0] == ["A"]
    assert res[True][1] == res[False][1] and set(res[True][1]) == {"A", "W"}


def test_an_aborted_id_reused_while_its_row_is_in_flight_gets_nothing_of_it():
    """abort("r") while r's row is in flight, then a new request "r": the old row's token
    must not land on the new request (the engine applies the step in flight first)."""
    res = {}
    for on in (True, False):
        eng = fake_engine(on, prefix=False)
        p = SamplingParams(max_tokens=6, temperature=0.0)
        eng.add_request("r", "abcd", p)
        eng.step(), eng.step()
        assert (eng._inflight is not None) == on
        eng.abort("r")
        eng.add_request("r", "xyz", p)
        res[on] = {rid: final(o) for rid, o in drain(eng).items()}
        kv = eng.scheduler.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks
    assert res[True] == res[False]
    assert res[True]["r"][0][1] == [30, 31, 32, 33, 34, 35]  # counts up from "z" (hand-checked)


@pytest.mark.parametrize("mode", ["abort", "finish"])
def test_planning_ahead_that_raises_after_queueing_commits(mode):
    """With prefix caching, planning ahead raises inside `schedule` once the step in
    flight's commits are queued (`commit_later`): they are made on the way out (not left
    to reach requests freed later), `step()` raises, and the engine goes on: the requests
    are aborted (or run to the end), no block is held, a new request runs alone."""
    eng = fake_engine(True, prefix=True)
    sp = SamplingParams(max_tokens=12 if mode == "finish" else 6, temperature=0.0)
    for i, p in enumerate(PROMPTS[:3]):
        eng.add_request(f"r{i}", p, sp)
    kv, real, raised = eng.scheduler.kv_cache_manager, eng.scheduler._schedule_running, []

    def flaky(*a, **kw):
        if not raised and kv._later:
            raised.append(1)
            raise RuntimeError("scheduler bug")
        return real(*a, **kw)

    eng.scheduler._schedule_running = flaky
    with pytest.raises(RuntimeError, match="scheduler bug"):
        for _ in range(50):
            eng.step()
    assert raised and not kv._later  # made on the way out
    if mode == "abort":
        for i in range(3):
            eng.abort(f"r{i}")
    for _ in range(60):
        eng.step()
        if not eng.has_unfinished_requests() and eng._inflight is None:
            break
    assert not eng.has_unfinished_requests() and not kv.owners()
    kv.check_invariants([])
    eng.add_request("again", PROMPTS[3], SamplingParams(max_tokens=4, temperature=0.0))
    got = [o for _ in range(20) for o in eng.step() if o.finished]
    ref = fake_engine(False)
    ref.add_request("again", PROMPTS[3], SamplingParams(max_tokens=4, temperature=0.0))
    want = [o for _ in range(20) for o in ref.step() if o.finished]
    assert [final(o) for o in got] == [final(o) for o in want]


def test_a_plan_made_ahead_that_fails_before_its_dispatch_is_taken_back():
    """`on_scheduled` raising for a plan made ahead (a review found it left the plan
    pending, undispatched, and every later step raised): it fails as that step's dispatch
    would, is planned again, and every request ends with the serial loop's tokens."""
    eng = fake_engine(True, prefix=True)
    sp = SamplingParams(max_tokens=8, temperature=0.0)
    for i, p in enumerate(PROMPTS[:3]):
        eng.add_request(f"r{i}", p, sp)
    real, raised = eng.outputs.on_scheduled, []

    def flaky(out, now):
        if not raised and eng._inflight is None and eng.scheduler._ahead_of is not None \
                and out.scheduled:
            raised.append(out.step)
            raise RuntimeError("on_scheduled bug")
        return real(out, now)

    eng.outputs.on_scheduled = flaky
    done = {o.request_id: final(o) for _ in range(40) for o in eng.step() if o.finished}
    ref = fake_engine(False, prefix=True)
    for i, p in enumerate(PROMPTS[:3]):
        ref.add_request(f"r{i}", p, sp)
    want = {o.request_id: final(o) for _ in range(40) for o in ref.step() if o.finished}
    assert raised and done == want and not eng.scheduler.kv_cache_manager.owners()
