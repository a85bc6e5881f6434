"""The real `LLMEngine` over the `FakeRunner`: fan-out, stop strings, validation and
failure paths in milliseconds, with counting tokens checked by hand.

Tiny vocabulary (tests/conftest.py): 0 <pad>, 1 <s>, 2 </s> (EOS), 3 ' ', 4..29 a-z,
30..55 A-Z, 56..65 0-9, 66 <unk>. `counting_token`: greedy output = last token + 1;
seeded sample i steps by 2 + (seed + i) % 5.
"""

from __future__ import annotations

import pytest

from conftest import tiny_tokenizer
from jaxserve.config import ModelConfig
from jaxserve.engine import LLMEngine, make_engine_config
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.fake_runner import FakeRunner, counting_token

EOS = 2


def fake(**kw):
    """An engine over the FakeRunner; runner options (fail_row, ...) go to the runner."""
    runner_kw = {k: kw.pop(k) for k in ("fail_row", "fail_step", "kv_lost_on_reset") if k in kw}
    args = dict(dict(max_model_len=64, block_size=4, num_kv_blocks=257, max_num_seqs=16,
                     max_num_batched_tokens=32), **kw)
    model = ModelConfig.tiny()
    config = make_engine_config(model, **args)
    runner = FakeRunner.for_config(config, token_fn=counting_token(67, config.max_logprobs),
                                   **runner_kw)
    return LLMEngine(config, tokenizer=tiny_tokenizer(), runner=runner)


def run(engine, rid="r", prompt="a", **kw):
    engine.add_request(rid, prompt, SamplingParams(**kw))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def free_all(engine) -> bool:
    kv = engine.scheduler.kv_cache_manager
    return kv.num_free_blocks == kv.num_blocks


def test_greedy_counts_up_from_last_prompt_token():
    eng = fake()
    outs = run(eng, prompt="a", max_tokens=5, temperature=0)
    final = outs[-1]
    assert final.finished and final.outputs[0].text == "bcdef"
    assert final.outputs[0].token_ids == [5, 6, 7, 8, 9]
    assert "".join(o.outputs[0].delta_text for o in outs) == "bcdef"
    assert final.outputs[0].finish_reason == "length"
    assert free_all(eng)
    assert eng.runner.stats().num_steps == 5  # one prefill + four decodes


def test_seeded_samples_use_seed_plus_index():
    eng = fake()
    final = run(eng, prompt="a", max_tokens=3, temperature=1.0, seed=3, n=2)[-1]
    # s_i = 2 + (3 + i) % 5 -> 5 and 6: 'a'=4 -> 9,14,19 and 10,16,22
    assert final.outputs[0].token_ids == [9, 14, 19]
    assert final.outputs[1].token_ids == [10, 16, 22]
    assert [o.text for o in final.outputs] == ["fkp", "gms"]


def test_eos_stop_and_ignore_eos():
    eng = fake()
    final = run(eng, prompt=[65], max_tokens=10, temperature=0)[-1]
    assert final.outputs[0].token_ids == [66, 0, 1, EOS]
    assert final.outputs[0].finish_reason == "stop"
    final = run(eng, prompt=[65], max_tokens=6, temperature=0, ignore_eos=True)[-1]
    assert final.outputs[0].token_ids == [66, 0, 1, EOS, 3, 4]
    assert final.outputs[0].finish_reason == "length"


def test_stop_string_is_cut_and_never_partly_emitted():
    eng = fake()
    outs = run(eng, prompt="a", max_tokens=10, temperature=0, stop=["def"])
    deltas = [o.outputs[0].delta_text for o in outs]
    assert "".join(deltas) == "bc" and outs[-1].outputs[0].stop_reason == "def"
    assert all("d" not in d for d in deltas)
    assert len(outs[-1].outputs[0].token_ids) == 5  # b c d e f
    assert outs[-1].outputs[0].finish_reason == "stop" and free_all(eng)


def test_stop_string_on_the_last_allowed_token_is_relabelled_stop():
    eng = fake()
    final = run(eng, prompt="a", max_tokens=5, temperature=0, stop=["ef"])[-1].outputs[0]
    # "bcdef": the stop string completes on token 5 = max_tokens; vLLM reports "stop".
    assert final.token_ids == [5, 6, 7, 8, 9] and final.text == "bcd"
    assert final.finish_reason == "stop" and final.stop_reason == "ef"


def test_chunked_prefill_emits_only_after_last_chunk():
    eng = fake(max_num_batched_tokens=8, max_num_seqs=4)
    eng.add_request("r", [5] * 20, SamplingParams(max_tokens=1, temperature=0))
    steps = []
    while eng.has_unfinished_requests():
        steps.append(eng.step())
    assert [len(s) for s in steps] == [0, 0, 1]  # 8 + 8 + 4 prompt tokens


def test_max_model_len_and_pool_validation():
    eng = fake(max_model_len=16, num_kv_blocks=6)
    with pytest.raises(ValueError, match="max_model_len=16"):
        eng.add_request("a", [1] * 16, SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("b", "", SamplingParams())
    ids = eng.add_request("d", [1] * 15, SamplingParams(max_tokens=5))  # clamps to 1 new token
    assert len(ids) == 15
    final = [o for o in eng.step()][-1]
    assert final.finished and len(final.outputs[0].token_ids) == 1
    assert not eng.has_unfinished_requests() and free_all(eng)
    # 5 usable blocks of 4 = 20 KV tokens; 15 + 10 - 1 = 24 need 6 blocks: never runnable.
    eng = fake(max_model_len=32, num_kv_blocks=6)
    with pytest.raises(ValueError, match="KV blocks"):
        eng.add_request("c", [1] * 15, SamplingParams(max_tokens=10, n=2))
    assert not eng.has_unfinished_requests() and free_all(eng)


def test_abort_frees_blocks():
    eng = fake()
    eng.add_request("x", "hello", SamplingParams(max_tokens=30, n=3))
    eng.step()
    kv = eng.scheduler.kv_cache_manager
    assert kv.num_free_blocks < kv.num_blocks
    assert eng.abort("x") and not eng.abort("x")
    assert free_all(eng) and not eng.has_unfinished_requests()
    assert eng.get_stats()["num_aborted"] == 1


def test_failing_row_fails_alone_and_batch_mates_keep_their_tokens():
    alone = run(fake(), "g", prompt="abc", max_tokens=6, temperature=0)[-1].outputs[0].token_ids
    eng = fake(fail_row=lambda req: req.request_id == "bad")
    eng.add_request("g", "abc", SamplingParams(max_tokens=6, temperature=0))
    eng.add_request("bad", "xyz", SamplingParams(max_tokens=6, temperature=0))
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert done["bad"].outputs[0].finish_reason == "error"
    assert done["bad"].outputs[0].error == "scripted request failure"
    assert done["g"].outputs[0].token_ids == alone == [7, 8, 9, 10, 11, 12]
    assert free_all(eng) and eng.get_stats()["num_failed_steps"] == 0


@pytest.mark.parametrize("kv_lost", [False, True])
def test_step_failure_retries_its_rows_once_then_fails_them(kv_lost):
    eng = fake(max_num_seqs=2, fail_step=lambda req: req.request_id == "boom",
               kv_lost_on_reset=kv_lost)
    eng.add_request("other", "abc", SamplingParams(max_tokens=40, temperature=0))
    eng.step()  # "other" runs alone first
    eng.add_request("boom", "hi", SamplingParams(max_tokens=3, temperature=0))
    eng.add_request("waiting", "q", SamplingParams(max_tokens=3, temperature=0))  # no seat yet
    # First failure: the plan's rows are preempted by recompute, to be retried; nobody ends.
    assert not any(o.finished for o in eng.step())
    assert eng.runner.num_resets == 1 and eng.get_stats()["num_failed_steps"] == 1
    assert eng.scheduler.kv_cache_manager.num_cached_blocks == 0  # prefix cache forgotten
    assert {r.request_id for r in eng.scheduler.running} == set()
    # The retry holds the same two rows and fails again: now they fail.
    outs = {o.request_id: o for o in eng.step()}
    assert outs["boom"].outputs[0].finish_reason == "error"
    assert "scripted step failure caused by boom" in outs["boom"].outputs[0].error
    assert outs["other"].outputs[0].finish_reason == "error"
    assert "waiting" not in outs  # never in a failed plan, and it held no KV to lose
    assert eng.runner.num_resets == 2 and eng.get_stats()["num_failed_steps"] == 2
    rest = {}
    while eng.has_unfinished_requests():
        rest.update({o.request_id: o for o in eng.step() if o.finished})
    assert rest["waiting"].outputs[0].text == "rst"  # counts on from 'q' (20)
    assert free_all(eng)
    again = run(eng, "z", prompt="abc", max_tokens=2, temperature=0)[-1].outputs[0]
    assert again.token_ids == [7, 8]


def test_logprobs_are_the_runners_top_alternatives_plus_the_chosen_token():
    eng = fake()
    final = run(eng, prompt="a", max_tokens=2, temperature=0, logprobs=2)[-1].outputs[0]
    assert final.logprobs[0] == pytest.approx({5: -0.1, 6: -1.1, 7: -2.1})
    assert final.cumulative_logprob == pytest.approx(-0.2)


def test_each_step_output_keeps_its_own_token_lists():
    """Cumulative fields are views copied when read (issue 24): an output read after
    later steps still holds exactly the tokens of its own step, as plain lists."""
    eng = fake()
    outs = run(eng, prompt="a", temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    assert [o.outputs[0].num_tokens for o in outs] == [1, 2, 3, 4, 5, 6]
    final = outs[-1].outputs[0]
    assert final.token_ids == [5, 6, 7, 8, 9, 10]  # "a" (4) counts up, greedy
    for k, o in enumerate(outs, start=1):  # read only now, after every step ran
        c = o.outputs[0]
        assert type(c.token_ids) is list and c.token_ids == final.token_ids[:k]
        assert c.token_logprobs == final.token_logprobs[:k] and len(c.logprobs) == k
        assert c.num_tokens == k


def test_the_runner_keeps_no_state_of_requests_ended_between_steps():
    """Requests aborted by a pause (a plan with no rows follows) or by `abort` are
    dropped from the runner's copies too: nothing accumulates across weight updates."""
    eng = fake()
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for rnd in range(3):
        for i in range(4):
            eng.add_request(f"r{rnd}.{i}", "abc", sp)
        eng.step()
        eng.step()
        assert len(eng.runner.requests) == 4
        eng.pause_generation("abort")
        eng.resume_generation()
        eng.step()  # a plan with no rows, carrying the aborted ids
        assert dict(eng.runner.requests) == {}, rnd
    eng.add_request("x", "abc", sp)
    eng.step()
    eng.abort("x")
    eng.step()
    assert dict(eng.runner.requests) == {} and free_all(eng)


def test_resume_inside_a_sleep_schedules_nothing_until_wake():
    eng = fake()
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    eng.pause_generation("abort")
    eng.sleep(1)
    eng.resume_generation()  # the user's pause ends; the sleep goes on
    eng.add_request("w", "a", sp)
    assert eng.step() == [] and eng.step() == []
    assert eng.scheduler.get_request("w").num_output_tokens == 0  # waits for the wake
    eng.wake_up()
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step()})
    assert done["w"].outputs[0].token_ids == [5, 6, 7, 8] and done["w"].finished


def test_a_sleep_that_fails_half_way_is_undone():
    """The runner freed part of its memory, then failed: the engine wakes it again, so
    it is neither asleep nor stuck, and generation goes on."""
    eng = fake()
    real_sleep = eng.runner.sleep

    def half_then_fail(level, *, discard_weights=False):
        real_sleep(level, discard_weights=discard_weights)  # the KV cache is freed
        raise RuntimeError("injected: freeing the weights failed")

    eng.runner.sleep = half_then_fail
    with pytest.raises(RuntimeError, match="injected"):
        eng.sleep(2)
    assert not eng.runner.is_sleeping and not eng.pauser.paused
    outs = run(eng, prompt="a", temperature=0.0, max_tokens=3, ignore_eos=True)
    assert outs[-1].outputs[0].token_ids == [5, 6, 7]
