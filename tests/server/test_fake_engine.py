"""The fake engine's scripted arithmetic, checked by hand (so server tests can trust it)."""

from __future__ import annotations

import pytest

from jaxserve.sampling_params import SamplingParams

from .fake_engine import EOS, FakeEngine, fake_config


def run(engine, rid="r", prompt="a", **kw):
    engine.add_request(rid, prompt, SamplingParams(**kw))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def test_greedy_counts_up_from_last_prompt_byte():
    eng = FakeEngine(step_delay=0)
    outs = run(eng, prompt="a", max_tokens=5, temperature=0)
    final = outs[-1]
    assert final.finished and final.outputs[0].text == "bcdef"
    assert final.outputs[0].token_ids == [98, 99, 100, 101, 102]
    assert "".join(o.outputs[0].delta_text for o in outs) == "bcdef"
    assert final.outputs[0].finish_reason == "length"
    assert eng.num_free_blocks == eng.num_total_blocks


def test_seeded_samples_use_seed_plus_index():
    eng = FakeEngine(step_delay=0)
    final = run(eng, prompt="a", max_tokens=3, temperature=1.0, seed=3, n=2)[-1]
    # s_i = 2 + (3 + i) % 5 -> 5 and 6: 'a'=97 -> 102,107,112 and 103,109,115
    assert final.outputs[0].token_ids == [102, 107, 112]
    assert final.outputs[1].token_ids == [103, 109, 115]


def test_eos_stop_and_ignore_eos():
    eng = FakeEngine(step_delay=0)
    final = run(eng, prompt=[253], max_tokens=10, temperature=0)[-1]
    assert final.outputs[0].token_ids == [254, 255, EOS]
    assert final.outputs[0].finish_reason == "stop"
    final = run(eng, prompt=[253], max_tokens=5, temperature=0, ignore_eos=True)[-1]
    assert final.outputs[0].token_ids == [254, 255, EOS, 257, 0]
    assert final.outputs[0].finish_reason == "length"


def test_stop_string_is_cut_and_never_partly_emitted():
    eng = FakeEngine(step_delay=0)
    outs = run(eng, prompt="a", max_tokens=10, temperature=0, stop=["def"])
    deltas = [o.outputs[0].delta_text for o in outs]
    assert "".join(deltas) == "bc" and outs[-1].outputs[0].stop_reason == "def"
    assert all("d" not in d for d in deltas)
    assert len(outs[-1].outputs[0].token_ids) == 5  # b c d e f


def test_chunked_prefill_emits_only_after_last_chunk():
    eng = FakeEngine(fake_config(max_num_batched_tokens=8, max_num_seqs=4, max_model_len=64), step_delay=0)
    eng.add_request("r", [5] * 20, SamplingParams(max_tokens=1, temperature=0))
    steps = []
    while eng.has_unfinished_requests():
        steps.append(eng.step())
    assert [len(s) for s in steps] == [0, 0, 1]  # 8 + 8 + 4 prompt tokens


def test_max_model_len_and_pool_validation():
    eng = FakeEngine(fake_config(max_model_len=16, num_kv_blocks=6), step_delay=0)
    with pytest.raises(ValueError, match="max_model_len=16"):
        eng.add_request("a", [1] * 16, SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("b", "", SamplingParams())
    with pytest.raises(ValueError, match="KV blocks"):
        eng.add_request("c", [1] * 15, SamplingParams(max_tokens=1, n=2))  # 4 + 2 > 5 blocks
    ids = eng.add_request("d", [1] * 15, SamplingParams(max_tokens=5))  # clamps to 1 new token
    assert len(ids) == 15
    final = [o for o in eng.step()][-1]
    assert final.finished and len(final.outputs[0].token_ids) == 1


def test_abort_frees_blocks():
    eng = FakeEngine(step_delay=0)
    eng.add_request("x", "hello", SamplingParams(max_tokens=30, n=3))
    eng.step()
    assert eng.num_free_blocks < eng.num_total_blocks
    assert eng.abort("x") and not eng.abort("x")
    assert eng.num_free_blocks == eng.num_total_blocks and not eng.has_unfinished_requests()
