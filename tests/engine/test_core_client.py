"""`MPEngine` (issue 24): the engine core in its own process, outputs assembled here.

The reference is the one-process `LLMEngine` over the same fake runner (tokens keyed on
request and position, so batch-independent): every request both runs finish ends with
the same tokens, text, finish and stop reasons, errors, logprobs, prompt logprobs and
weight versions. One core process serves every workload of a test (ids differ), so the
module starts few interpreters. Over: random add / abort / step interleavings with stop
strings, stop ids, min_tokens, n > 1, logprobs, prompt logprobs, seeds and rows that fail
alone (hypothesis); whole steps that fail; structured output (matchers in the core, text
flushed here); a weight update between steps (`call`); an add the core refuses; the
core's KV blocks all free after each workload.
"""

from __future__ import annotations

import functools
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import drain, tiny_tokenizer
from jaxserve.config import ModelConfig
from jaxserve.engine import LLMEngine, make_engine_config
from jaxserve.engine.core_client import EngineCoreError, MPEngine
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from jaxserve.worker.fake_runner import FakeRunner, counting_token
from tests.engine.test_async_scheduling import PROMPTS, _h, _kv_free, _prefix_of, run_ops


def build(*, fail_rows: bool = False, fail_steps: bool = False, refuse: str | None = None,
          seqs: int = 4) -> LLMEngine:
    """The engine of both runs (built in the core process for `MPEngine`)."""
    model = ModelConfig.tiny()
    config = make_engine_config(model, max_model_len=32, block_size=4, num_kv_blocks=40,
                                max_num_seqs=seqs, max_num_batched_tokens=16)

    def row_fails(req) -> bool:
        return fail_rows and _h(req.request_id, req.num_output_tokens) % 17 == 0

    def step_fails(req) -> bool:
        return fail_steps and _h(req.request_id, req.num_computed_tokens) % 29 == 0

    runner = FakeRunner.for_config(config, token_fn=counting_token(model.vocab_size, 2),
                                   fail_row=row_fails, fail_step=step_fails)
    runner.update_params = lambda params: None  # the fake has no weights to swap
    eng = LLMEngine(config, tokenizer=tiny_tokenizer(), runner=runner, warmup=False)
    if refuse is not None:  # a core-side refusal (as an unknown adapter or grammar would be)
        add = eng.add_processed

        def add_processed(p, lora_request=None):
            if p.request_id.endswith(refuse):
                raise ValueError(f"refused {p.request_id}")
            add(p, lora_request)
        eng.add_processed = add_processed
    return eng


def final(o) -> list[tuple]:
    return [(c.index, list(c.token_ids), c.text, c.finish_reason, c.stop_reason, c.error,
             round(c.cumulative_logprob, 6), c.logprobs and list(c.logprobs),
             list(c.token_weight_versions)) for c in o.outputs] + [o.prompt_logprobs]


def run(eng, ops, tag: str) -> tuple[dict, dict, list]:
    """`run_ops` with this module's `final`, ids tagged, and every step's outputs
    returned; the core's KV checked through `call`."""
    steps = []
    finals, aborted = run_ops(eng, ops, tag=tag, final=final, steps=steps,
                              kv_free=lambda e: _call(e, _kv_free))
    return finals, aborted, steps


def _call(eng, fn):
    return eng.call(fn) if isinstance(eng, MPEngine) else fn(eng)


@pytest.fixture(scope="module")
def mp():
    with MPEngine(functools.partial(build, fail_rows=True)) as eng:
        yield eng


_params = st.builds(
    lambda n, mt, greedy, seed, stop, stop_id, min_t, lp, plp, kind: SamplingParams(
        n=n, max_tokens=mt, temperature=0.0 if greedy else 1.0, seed=seed,
        stop=(stop,) if stop else (), stop_token_ids=(stop_id,) if stop_id else (),
        min_tokens=min(min_t, mt), logprobs=lp, prompt_logprobs=plp, output_kind=kind),
    n=st.integers(1, 3), mt=st.integers(1, 14), greedy=st.booleans(), seed=st.integers(0, 99),
    stop=st.sampled_from([None, None, "g", "hi", "D", "ef"]),
    stop_id=st.sampled_from([None, None, 9, 2]), min_t=st.integers(0, 3),
    lp=st.sampled_from([None, 0, 2]), plp=st.sampled_from([None, None, 1]),
    kind=st.sampled_from([RequestOutputKind.CUMULATIVE, RequestOutputKind.CUMULATIVE,
                          RequestOutputKind.FINAL_ONLY]))
_op = st.one_of(
    st.tuples(st.just("add"), st.sampled_from(PROMPTS), _params),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("step"), st.integers(1, 3)),
)
_example = [0]


@settings(max_examples=int(os.environ.get("JAXSERVE_PROPERTY_EXAMPLES", "25")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(ops=st.lists(_op, min_size=1, max_size=25))
def test_random_interleavings_give_the_one_process_outputs(mp, ops):
    _example[0] += 1
    tag = f"x{_example[0]}-"
    got, ab_mp, _ = run(mp, ops, tag)
    ref, ab_ref, _ = run(build(fail_rows=True), ops, tag)
    # An abort lands between the same two calls but not at the same progress (the core
    # runs a step or two ahead): a request may finish in one run and be aborted in the
    # other, having shown a prefix of its tokens. Every request both finished is identical.
    both = got.keys() & ref.keys()
    assert {r: got[r] for r in both} == {r: ref[r] for r in both}
    assert got.keys() - both <= ab_ref.keys() and ref.keys() - both <= ab_mp.keys()
    for fin, ab in ((got, ab_ref), (ref, ab_mp)):
        for rid in ab.keys() & fin.keys():
            for seen, c in zip(ab[rid], fin[rid]):
                assert _prefix_of(seen, c[1]), (rid, seen, c[1])


@pytest.fixture(scope="module")
def mp1():
    with MPEngine(functools.partial(build, fail_rows=True), steps_ahead=1) as eng:
        yield eng


@settings(max_examples=int(os.environ.get("JAXSERVE_PROPERTY_EXAMPLES", "25")) // 2 + 1,
          deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(ops=st.lists(_op, min_size=1, max_size=25))
def test_one_step_ahead_too(mp1, ops):
    """The same property with the core held to one step ahead of this side (the default
    lets it run two)."""
    test_random_interleavings_give_the_one_process_outputs.hypothesis.inner_test(mp1, ops)


def test_steps_ahead_below_one_is_refused():
    with pytest.raises(ValueError, match="steps_ahead=0"):
        MPEngine(build, steps_ahead=0)


def test_each_step_streams_what_the_one_process_engine_streams(mp):
    """Without aborts, each request's successive outputs (not only its final one) are the
    one-process engine's: the frontend collects where the core's engine collected. A
    weight update between steps: the versions rise from 0 to 1 along each sample (where
    depends on how far the core had run ahead when the update reached it)."""
    sp = [SamplingParams(max_tokens=10 + s, temperature=1.0, seed=s, n=1 + s % 2,
                         stop=("hi",) if s % 3 == 0 else ()) for s in range(5)]
    ops = [("add", PROMPTS[i], sp[i]) for i in range(3)] + [("step", 2), ("update",)]
    ops += [("add", PROMPTS[i], sp[i]) for i in range(3, 5)]
    got, _, got_steps = run(mp, ops, "s-")
    ref, _, ref_steps = run(build(fail_rows=True), ops, "s-")
    assert _without_versions(got) == _without_versions(ref)
    for steps in (got_steps, ref_steps):
        assert len(steps) > len(got)  # streamed, not only final outputs
    by_request = [{rid: [s[1:] for s in steps if s[0] == rid] for rid in got}
                  for steps in (got_steps, ref_steps)]
    assert by_request[0] == by_request[1]
    versions = [c[8] for outs in got.values() for c in outs[:-1]]
    assert all(v == sorted(v) and set(v) <= {0, 1} for v in versions)
    assert {0, 1} <= {x for v in versions for x in v}


def _without_versions(finals: dict) -> dict:
    return {rid: [c[:8] for c in outs[:-1]] + outs[-1:] for rid, outs in finals.items()}


def test_a_sample_its_stop_string_ended_gets_none_of_the_cores_later_tokens():
    """n = 2, seed 0: sample 1 meets "g" at its first token while sample 0 runs on (the
    one-process engine's outputs, checked here too). The core has made sample 1's next
    token before the frontend found the stop string; the frontend drops it."""
    sp = SamplingParams(n=2, max_tokens=14, temperature=1.0, seed=0, stop=("g",))
    ref, _, _ = run(build(), [("add", "abcd", sp)], "g2-")
    assert [(c[3], len(c[1])) for c in ref["g2-0"][:-1]] == [("length", 14), ("stop", 1)]
    with MPEngine(build) as eng:
        got, _, got_steps = run(eng, [("add", "abcd", sp)], "g2-")
    assert got == ref
    assert all(len(s[1][1]) <= 1 for s in got_steps)  # in every output, not only the last


def test_whole_step_failures_end_as_in_one_process():
    """Steps that fail as a whole (retried once, then "error"): each sample ends as in the
    one-process run with the same failures, or, where a step failure ended it (which rows
    share a failing step depends on the plans), with a prefix of its tokens."""
    sp = [SamplingParams(max_tokens=12, temperature=1.0, seed=s, stop=("hi", "D")[s % 2:][:1],
                         n=1 + s % 2) for s in range(6)]
    ops = [("add", PROMPTS[i % len(PROMPTS)], sp[i]) for i in range(6)]
    ref, _, _ = run(build(fail_rows=True, fail_steps=True), ops, "f-")
    with MPEngine(functools.partial(build, fail_rows=True, fail_steps=True)) as eng:
        got, _, _ = run(eng, ops, "f-")
    assert got.keys() == ref.keys()
    errors = 0
    for rid, outs in got.items():
        for c, r in zip(outs[:-1], ref[rid][:-1], strict=True):
            if c != r:
                assert "scripted step" in (c[5] or "") + (r[5] or ""), (rid, c, r)
                assert _prefix_of(c[1], r[1]) or _prefix_of(r[1], c[1]), (rid, c, r)
                errors += 1
    assert sum(c[3] == "error" for outs in got.values() for c in outs[:-1]) >= 2


def test_an_add_the_core_refuses_ends_with_its_error():
    with MPEngine(functools.partial(build, refuse="bad")) as eng:
        eng.add_request("ok", "abcd", SamplingParams(max_tokens=3, temperature=0.0,
                                                     ignore_eos=True))  # (no EOS by chance)
        eng.add_request("bad", "abcd", SamplingParams(max_tokens=3, n=2))
        outs = {}
        while eng.has_unfinished_requests():
            outs.update((o.request_id, o) for o in eng.step() if o.finished)
        assert eng.call(_kv_free)
    assert [c.finish_reason for c in outs["bad"].outputs] == ["error", "error"]
    assert outs["bad"].outputs[0].error == "ValueError: refused bad"
    assert outs["ok"].outputs[0].finish_reason == "length"
    assert len(outs["ok"].outputs[0].token_ids) == 3


def test_structured_output_matchers_in_the_core_text_here():
    from test_structured_output import SCHEMAS

    ops = [("add", "go", SamplingParams(max_tokens=60, structured_outputs={"json": SCHEMAS[0]})),
           ("add", "hey", SamplingParams(max_tokens=20, stop=("k",))), ("step", 3),
           ("add", "more", SamplingParams(max_tokens=10))]
    with MPEngine(_grammar_engine) as eng:
        got, _, _ = run(eng, ops, "g-")
    ref, _, _ = run(_grammar_engine(), ops, "g-")
    assert got == ref
    assert got["g-0"][0][3] == "stop" and got["g-0"][0][2].startswith("{")


def _grammar_engine() -> LLMEngine:
    from test_structured_output import MODEL_VOCAB, ascii_tokenizer
    from jaxserve.worker.fake_runner import default_token

    model = ModelConfig.tiny(vocab_size=MODEL_VOCAB, max_position_embeddings=512)
    config = make_engine_config(model, max_model_len=128, block_size=4, num_kv_blocks=200,
                                max_num_seqs=4, max_num_batched_tokens=32)
    runner = FakeRunner.for_config(
        config, token_fn=lambda r, pos: default_token(r.request_id, pos, vocab_size=98))
    return LLMEngine(config, tokenizer=ascii_tokenizer(), runner=runner)


def test_a_factory_that_raises_is_a_clear_error():
    def broken():
        raise RuntimeError("no weights here")
    with pytest.raises(EngineCoreError, match="RuntimeError: no weights here"):
        MPEngine(broken)


def test_an_id_aborted_and_reused_gets_none_of_the_old_requests_events():
    """abort("r") then a new "r" at once: steps the core ran before it saw the abort still
    arrive with the old r's tokens; none lands on the new r. The same for an id reused
    right after its stop string ended it here (the core had run on meanwhile)."""
    ref = build()
    ref.add_request("r", "abcd", SamplingParams(max_tokens=1))
    stop = drain(ref)["r"].outputs[0].text[:1]  # r's first token's text: a stop at once
    assert stop
    with MPEngine(build) as eng:
        for end in ("abort", "stop"):
            p = SamplingParams(max_tokens=6, temperature=0.0,
                               stop=(stop,) if end == "stop" else ())
            eng.add_request("r", "abcd", p)
            outs = []
            while len(outs) < 2 or (end == "stop" and not outs[-1].finished):
                outs += eng.step()
            if end == "abort":
                assert eng.abort("r")
            else:
                assert outs[-1].outputs[0].stop_reason == stop
            eng.add_request("r", "xyz", SamplingParams(max_tokens=6, temperature=0.0))
            got = {}
            while eng.has_unfinished_requests():
                got.update((o.request_id, o) for o in eng.step() if o.finished)
            c = got["r"].outputs
            assert len(c) == 1 and c[0].token_ids == [30, 31, 32, 33, 34, 35], c
            assert c[0].finish_reason == "length"
            assert eng.call(_kv_free)


def _tiny_real_engine() -> LLMEngine:
    from conftest import tiny_engine

    return tiny_engine()


def test_the_real_tiny_model_in_the_core_gives_the_one_process_outputs():
    """The real `ModelRunner` (tiny model, jax in the core process only): greedy and
    seeded tokens, text, stop strings, n = 2 and logprobs as the one-process engine's."""
    from conftest import tiny_engine
    from tests.engine.test_async_scheduling import _tiny_workload, assert_same
    from tests.engine.test_async_scheduling import final as final_of

    ops = [("add", p, sp) for _, p, sp in _tiny_workload()]
    with MPEngine(_tiny_real_engine) as eng:
        got, _ = run_ops(eng, ops, final=final_of, kv_free=lambda e: e.call(_kv_free))
        assert eng.call(lambda e: e.get_stats()["num_compiles_after_warmup"]) == 0
    ref, _ = run_ops(tiny_engine(), ops, final=final_of)
    assert_same(got, ref)
    assert any(c[3] == "stop" for outs in got.values() for c in outs)


def test_call_returns_values_and_raises_the_cores_exceptions(mp):
    """`call`: a value comes back; an exception raised in the core is raised here (one
    that does not pickle, as a RuntimeError naming it); the core serves on."""
    assert mp.call(lambda e: e.config.scheduler.max_num_seqs) == 4
    with pytest.raises(ValueError, match="already paused|not paused"):
        mp.call(lambda e: e.resume_generation())

    class Unpicklable(Exception):
        def __reduce__(self):
            raise TypeError("no")
    with pytest.raises(RuntimeError, match="Unpicklable: inside"):
        mp.call(lambda e: (_ for _ in ()).throw(Unpicklable("inside")))
    assert mp.call(_kv_free)


def _drain(eng) -> dict:
    outs = {}
    for _ in range(500):
        if not eng.has_unfinished_requests():
            return outs
        outs.update((o.request_id, o) for o in eng.step() if o.finished)
    raise AssertionError("MPEngine did not finish its requests in 500 steps")


def test_what_a_call_ends_reaches_the_frontend_and_never_a_reused_id():
    """The cold review's cases. An abort done in the core (`abort_older_than` through
    `call`) ends the request here too (no output, as in one process; no endless step()).
    A pause's abort through `call`, then the id aborted and reused at once: the failure
    recorded while the call ran is the old request's, not the new one's; the same for a
    refused add whose id is reused. The core holds nothing afterwards."""
    with MPEngine(functools.partial(build, refuse="bad")) as eng:
        eng.add_request("a", "abcd", SamplingParams(max_tokens=20))
        eng.step()
        assert eng.call(lambda e: e.abort_older_than(1)) == ["a"]
        assert _drain(eng) == {} and not eng.has_unfinished_requests()
        eng.add_request("r", "abcd", SamplingParams(max_tokens=20))
        eng.step(), eng.step()
        eng.call(lambda e: e.pause_generation("abort"))
        eng.call(lambda e: e.resume_generation())
        assert eng.abort("r")
        eng.add_request("r", "xyz", SamplingParams(max_tokens=6, temperature=0.0))
        c = _drain(eng)["r"].outputs[0]
        assert (c.finish_reason, c.error, len(c.token_ids)) == ("length", None, 6)
        eng.add_request("xbad", "abcd", SamplingParams(max_tokens=3))
        assert eng.abort("xbad")
        eng.add_request("xbad", "abcd", SamplingParams(max_tokens=3), lora_request=None)
        out = _drain(eng)["xbad"].outputs[0]  # the core refuses it again: its own error
        assert out.finish_reason == "error" and out.error == "ValueError: refused xbad"
        assert eng.call(lambda e: e.outputs.num_live) == 0 and eng.call(_kv_free)


def test_the_first_step_after_idle_has_the_new_requests_output():
    """An idle core runs the credit left out; that empty step is not handed back as the
    first step() after an add (the one-process engine's first step has the request)."""
    ref = build()
    ref.add_request("b", "abcd", SamplingParams(max_tokens=3))
    want = [o.request_id for o in ref.step()]
    with MPEngine(build) as eng:
        eng.add_request("a", "abcd", SamplingParams(max_tokens=2))
        _drain(eng)
        eng.add_request("b", "abcd", SamplingParams(max_tokens=3))
        assert [o.request_id for o in eng.step()] == want == ["b"]
        _drain(eng)


def _long_prompt_engine() -> LLMEngine:
    model = ModelConfig.tiny(max_position_embeddings=32768)
    config = make_engine_config(model, max_model_len=32768, block_size=16, num_kv_blocks=4096,
                                max_num_seqs=4, max_num_batched_tokens=8192,
                                enable_prompt_logprobs=True)
    runner = FakeRunner.for_config(config, token_fn=counting_token(model.vocab_size, 2),
                                   step_delay=0.3)
    return LLMEngine(config, tokenizer=tiny_tokenizer(), runner=runner, warmup=False)


def test_a_large_command_while_the_core_sends_a_large_step_does_not_deadlock():
    """The core blocked sending a chunk's prompt logprobs (MBs) while the frontend sends a
    20 MB `call` (a weight tree, say): the frontend reads while it sends."""
    import threading

    with MPEngine(_long_prompt_engine) as eng:
        eng.add_request("b", list(range(4, 60)) * 500, SamplingParams(  # (no EOS by chance)
            max_tokens=4, prompt_logprobs=20, temperature=0.0, ignore_eos=True))
        eng.step()  # chunk 1 read; the core now runs chunk 2, a large message too
        big = b"x" * (20 << 20)
        done = []
        t = threading.Thread(target=lambda: done.append(eng.call(lambda e, w=big: len(w))),
                             daemon=True)
        t.start()
        t.join(60)
        if not done:  # deadlocked: free the test process's socket before failing
            os.kill(eng._proc.pid, 9)
        assert done == [len(big)], "call blocked: both sides sending"
        out = _drain(eng)["b"]
        assert out.outputs[0].finish_reason == "length" and len(out.prompt_logprobs) == 28000


def _raises_once() -> LLMEngine:
    eng = build()
    step, calls = eng._step, [0]

    def _step(*a, **kw):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("planning broke once")
        return step(*a, **kw)
    eng._step = _step
    return eng


def test_a_step_that_raises_in_the_core_raises_here_and_the_core_serves_on():
    with MPEngine(_raises_once) as eng:
        eng.add_request("a", "abcd", SamplingParams(max_tokens=5, temperature=0.0))
        with pytest.raises(RuntimeError, match="planning broke once"):
            for _ in range(10):
                eng.step()
        out = _drain(eng)["a"].outputs[0]
        assert out.finish_reason == "length" and len(out.token_ids) == 5
        assert eng.call(_kv_free)


def test_delta_outputs_add_up_to_the_one_process_outputs(mp):
    """RequestOutputKind.DELTA (n = 2, a stop string, logprobs): each sample's deltas,
    joined, are the one-process engine's cumulative output (which steps carry which
    delta follows the core's pace, so the deltas themselves are not compared)."""
    kw = dict(n=2, max_tokens=12, temperature=1.0, seed=5, stop=("hi",), logprobs=1)
    ref = build(fail_rows=True)
    ref.add_request("d", "abcdefgh", SamplingParams(**kw))
    want = {c.index: (c.token_ids, c.text, c.finish_reason) for c in drain(ref)["d"].outputs}
    mp.add_request("d", "abcdefgh", SamplingParams(**kw, output_kind=RequestOutputKind.DELTA))
    got = {0: ([], "", None), 1: ([], "", None)}
    while mp.has_unfinished_requests():
        for o in mp.step():
            for c in o.outputs:
                ids, text, _ = got[c.index]
                got[c.index] = (ids + c.token_ids, text + c.text, c.finish_reason)
    assert got == want
