"""Isolation in the step: one bad row never harms its batch-mates (issue 13).

* On the real tiny-model runner: a request whose own host work fails (its
  sampling row cannot be written: a seed outside [0, 2**64), injected after
  validation, standing in for any per-row host failure) ends alone with
  finish_reason "error" and a message naming the fault; its batch-mates (greedy
  and seeded) finish with exactly the tokens they produce alone.
* On the FakeRunner: a scripted failing row among good ones; and a whole-step
  failure, after which issue 13 wants the surviving requests retried once.
"""

from __future__ import annotations

import pytest

from conftest import tiny_engine, tiny_tokenizer
from jaxserve.config import ModelConfig
from jaxserve.engine import LLMEngine, make_engine_config
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.fake_runner import FakeRunner, counting_token

GOOD = [
    ("g1", [5, 9, 14, 22], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)),
    ("s1", [7, 7, 30, 41, 52], SamplingParams(temperature=0.9, seed=3, max_tokens=10,
                                               ignore_eos=True)),
    ("g2", [60, 3, 3], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                      repetition_penalty=1.3)),
]


def _drain(engine, ids) -> dict:
    done = {}
    try:
        for _ in range(2000):
            if not engine.has_unfinished_requests():
                return done
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0]
        pytest.fail("engine did not drain")
    finally:
        for rid in ids:
            engine.abort(rid)


def test_failing_row_on_the_model_runner_spares_its_batch_mates():
    eng = tiny_engine()
    alone = {}
    for rid, p, sp in GOOD:
        eng.add_request(rid, p, sp)
        alone.update(_drain(eng, [rid]))
    for rid, p, sp in GOOD:
        eng.add_request(rid + "b", p, sp)
    eng.add_request("bad", [11, 12, 13], SamplingParams(temperature=0.7, max_tokens=10))
    eng.scheduler.requests["bad"].seed = -1  # its sampling row can never be written
    done = _drain(eng, [r + "b" for r, _, _ in GOOD] + ["bad"])
    assert done["bad"].finish_reason == "error" and "seed=-1" in done["bad"].error
    for rid, _, _ in GOOD:
        assert done[rid + "b"].finish_reason == "length"
        assert done[rid + "b"].token_ids == alone[rid].token_ids, rid
    kv = eng.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def _fake_engine(**runner_kw) -> LLMEngine:
    model = ModelConfig.tiny()
    config = make_engine_config(model, max_model_len=64, block_size=4, num_kv_blocks=64,
                                max_num_seqs=8, max_num_batched_tokens=32)
    runner = FakeRunner.for_config(config, token_fn=counting_token(model.vocab_size, 0),
                                   **runner_kw)
    return LLMEngine(config, tokenizer=tiny_tokenizer(), runner=runner, warmup=False)


def test_scripted_row_error_fails_that_request_alone():
    eng = _fake_engine(fail_row=lambda req: req.request_id == "bad")
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    for rid in ("a", "bad", "b"):
        eng.add_request(rid, "abc" if rid != "b" else "xy", sp)
    done = _drain(eng, ["a", "bad", "b"])
    assert done["bad"].finish_reason == "error" and done["bad"].error == "scripted request failure"
    # Greedy counting (helpers.py's vocabulary: a-z then A-Z): "abc" -> "defgh", "xy" -> "zABCD".
    assert done["a"].text == "defgh" and done["b"].text == "zABCD"


def test_whole_step_failure_retries_the_survivors_once():
    failures = {"n": 0}

    def fail_once(req) -> bool:  # the first step that holds "a" fails, later ones succeed
        if req.request_id == "a" and failures["n"] == 0:
            failures["n"] += 1
            return True
        return False

    eng = _fake_engine(fail_step=fail_once)
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    eng.add_request("a", "abc", sp)
    eng.add_request("b", "abc", sp)
    done = _drain(eng, ["a", "b"])
    assert failures["n"] == 1
    assert done["a"].text == done["b"].text == "defgh"  # retried, then finished normally


def test_a_step_that_fails_again_fails_its_requests_and_frees_every_block():
    calls = {"n": 0}

    def always(req) -> bool:  # every step holding "a" fails: the retry fails too
        calls["n"] += 1
        return req.request_id == "a"

    eng = _fake_engine(fail_step=always)
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    eng.add_request("a", "abc", sp)
    eng.add_request("b", "xy", sp)
    done = _drain(eng, ["a", "b"])
    # Both rows shared the failing step twice (first try, then the one retry): both fail.
    assert done["a"].finish_reason == done["b"].finish_reason == "error"
    assert eng.get_stats()["num_failed_steps"] == 2
    kv = eng.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
