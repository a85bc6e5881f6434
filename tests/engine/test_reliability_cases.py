"""Issue 13's three engine-level failure cases, on the tiny model (each failed before the fix).

1. `top_k=2**40` was accepted and overflowed the int32 sampling array inside the
   step, failing every request of the batch; now it means "no top-k" (vLLM PR #14234).
2. Out-of-vocabulary `stop_token_ids` were accepted (and `2**40` with min_tokens
   failed the batch); now add_request rejects them, naming the field and vocab_size
   (vLLM PR #54196).
3. The text of the stopping token (EOS with skip_special_tokens=False, or a stop
   token id) was returned; now it is left out unless include_stop_str_in_output,
   and the id stays in token_ids (vLLM).

The oracles are independent of the code under test: the same request run alone,
the same seed with top_k=0, and the tokenizer's own decode of the token ids.
"""

from __future__ import annotations

import pytest

from conftest import tiny_engine, tiny_tokenizer
from jaxserve.sampling_params import SamplingParams

V = 67  # tiny vocab
EOS = 2
PROMPT = [5, 9, 14, 22, 31, 40, 7]


def run(engine, reqs):
    """reqs: [(id, prompt, params)] -> {id: final RequestOutput}; leaves the engine idle."""
    try:
        for rid, p, sp in reqs:
            engine.add_request(rid, p, sp)
        done, steps = {}, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            steps += 1
            assert steps < 2000
        return done
    finally:  # a failing assertion must not leave requests in the shared cached engine
        for rid, _, _ in reqs:
            engine.abort(rid)


def test_huge_top_k_is_no_top_k_and_spares_its_batch_mate():
    eng = tiny_engine()
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = run(eng, [("g", PROMPT, greedy)])["g"].outputs[0]
    sampled = SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    ref = run(eng, [("r", PROMPT[:4], sampled)])["r"].outputs[0]
    done = run(eng, [("g2", PROMPT, greedy),
                     ("big", PROMPT[:4], sampled.replace(top_k=2**40))])
    for rid in ("g2", "big"):
        assert done[rid].outputs[0].finish_reason == "length", done[rid].outputs[0]
    assert done["g2"].outputs[0].token_ids == alone.token_ids
    assert done["big"].outputs[0].token_ids == ref.token_ids  # top_k >= V is top_k = 0


@pytest.mark.parametrize("bad", [V, 2**31, 2**40])
def test_out_of_vocab_stop_token_ids_are_rejected_at_submission(bad):
    eng = tiny_engine()
    limit = f"vocab_size={V}" if bad < 2**31 else "2\\*\\*31"  # int32 ids fail at construction
    try:
        with pytest.raises(ValueError, match=rf"stop_token_ids\[1\]={bad}: must be a token id "
                                             rf"in \[0, {limit}"):
            eng.add_request("bad", PROMPT, SamplingParams(max_tokens=4, min_tokens=2,
                                                          stop_token_ids=[5, bad]))
    finally:
        eng.abort("bad")
    assert not eng.has_unfinished_requests()
    sp = SamplingParams(max_tokens=4, min_tokens=2)
    ok = run(eng, [("ok", PROMPT, sp.replace(stop_token_ids=(5, V - 1)))])  # in vocab: fine
    assert ok["ok"].outputs[0].finish_reason in ("stop", "length")


def _first_eos_seed(eng):
    """A seed whose sampled continuation of PROMPT contains EOS (found, not assumed).

    With ignore_eos the sampler treats EOS like any token and the key depends only on
    (seed, position), so the same seed without ignore_eos stops at that EOS.
    """
    sp = SamplingParams(temperature=1.5, max_tokens=24, ignore_eos=True)
    done = run(eng, [(f"s{s}", PROMPT, sp.replace(seed=s)) for s in range(48)])
    for s in range(48):
        ids = done[f"s{s}"].outputs[0].token_ids
        if EOS in ids[1:]:
            return s, ids[:ids.index(EOS) + 1]
    pytest.fail("no seed in 0..47 sampled EOS within 24 tokens")


def test_eos_text_is_not_returned_with_skip_special_tokens_false():
    eng = tiny_engine()
    tok = tiny_tokenizer()
    seed, ids = _first_eos_seed(eng)
    sp = SamplingParams(temperature=1.5, seed=seed, max_tokens=24, skip_special_tokens=False)
    out = run(eng, [("e", PROMPT, sp)])["e"].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == ids  # the EOS id stays
    assert out.text == tok.decode(ids[:-1], skip_special_tokens=False)
    assert not out.text.endswith("</s>")
    inc = run(eng, [("i", PROMPT, sp.replace(include_stop_str_in_output=True))])["i"].outputs[0]
    assert inc.text == tok.decode(ids, skip_special_tokens=False) and inc.text.endswith("</s>")


def test_stop_token_id_text_is_not_returned():
    eng = tiny_engine()
    tok = tiny_tokenizer()
    free = run(eng, [("f", PROMPT, SamplingParams(temperature=0.0, max_tokens=8,
                                                  ignore_eos=True))])["f"].outputs[0].token_ids
    t = free[3]
    k = free.index(t)  # the first occurrence is where the stop fires
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=[t])
    out = run(eng, [("s", PROMPT, sp)])["s"].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == t
    assert out.token_ids == free[:k + 1]
    assert out.text == tok.decode(free[:k])
    inc = run(eng, [("si", PROMPT, sp.replace(include_stop_str_in_output=True))])["si"]
    assert inc.outputs[0].text == tok.decode(free[:k + 1])
