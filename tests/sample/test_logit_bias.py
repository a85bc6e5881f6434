"""logit_bias: the exact effect on the logits (float64 NumPy reference), the validator's
limits, and no compile after warm-up on the tiny engine with biased and plain rows mixed.

Order (vLLM V1's sampler): bias first, then repetition/frequency/presence penalties,
then min_tokens suppression; raw logprobs ignore all of them, processed ones do not.
"""

from __future__ import annotations

import functools
import math

import jax
import numpy as np
import pytest

from conftest import tiny_engine
from jaxserve.sample.sampler import SamplingRow, make_sampling_metadata, sample
from jaxserve.sampling_params import SamplingParams
from jaxserve.validation import (MAX_LOGIT_BIAS, Limits, ValidationError,
                                 validate_sampling_params)

S, V, M = 4, 67, 16


def _row(bias=(), **kw):
    return SamplingRow(SamplingParams(temperature=0.0, logit_bias=dict(bias), **kw), seed=0,
                       output_pos=0, prompt_token_ids=[3, 9], output_token_ids=[],
                       eos_token_ids=())


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@functools.lru_cache(maxsize=None)
def _sample(mode: str):
    return jax.jit(functools.partial(sample, max_logprobs=V, logprobs_mode=mode))


def test_bias_effect_matches_numpy_reference():
    rng = np.random.default_rng(17)
    logits = rng.normal(0, 3, (S, V)).astype(np.float32)
    full = {int(t): float(b) for t, b in zip(rng.permutation(V)[:60],
                                             rng.uniform(-100, 100, 60))}
    rows = [_row({5: 100.0, 9: -100.0}),  # 9 is also in the history: bias, then penalty
            None,  # a padding row
            _row(full),
            _row({9: 3.5}, repetition_penalty=2.0)]
    md = make_sampling_metadata(rows, num_rows=S, max_model_len=M)
    ref = logits.astype(np.float64).copy()
    ref[0, 5] += 100.0
    ref[0, 9] -= 100.0
    for t, b in full.items():
        ref[2, t] += b
    ref[3, 9] += 3.5
    # CTRL penalty on the seen ids 3 and 9, after the bias: positive / 2, negative * 2.
    for t in (3, 9):
        ref[3, t] = ref[3, t] / 2.0 if ref[3, t] > 0 else ref[3, t] * 2.0
    out = jax.device_get(_sample("processed_logprobs")(logits, md))
    np.testing.assert_array_equal(out.token_ids, ref.argmax(-1))
    want = _log_softmax(ref)
    got = np.full((S, V), np.nan)
    np.put_along_axis(got, out.top_ids, out.top_logprobs, -1)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-5)
    # Raw logprobs are the model's: the bias changes the token, not the reported distribution.
    raw = jax.device_get(_sample("raw_logprobs")(logits, md))
    np.testing.assert_array_equal(raw.token_ids, out.token_ids)
    np.testing.assert_allclose(raw.logprobs, _log_softmax(logits)[np.arange(S), raw.token_ids],
                               atol=1e-5)


def test_metadata_is_fixed_shape_with_zero_padding():
    md = make_sampling_metadata([_row({7: -2.0, 3: 1.5})], num_rows=2, max_model_len=M)
    assert md.logit_bias_ids.shape == md.logit_bias_values.shape == (2, MAX_LOGIT_BIAS)
    assert md.logit_bias_ids[0, :2].tolist() == [3, 7]  # sorted by id
    assert md.logit_bias_values[0, :2].tolist() == [1.5, -2.0]
    assert not md.logit_bias_ids[:, 2:].any() and not md.logit_bias_values[:, 2:].any()
    assert not md.logit_bias_ids[1].any() and not md.logit_bias_values[1].any()


def test_rows_without_bias_or_min_tokens_share_the_device_constants():
    """No row biased / under min_tokens: the bias and suppression inputs are the shared
    read-only constants the runner keeps on the device (not copied each step); one such
    row makes them fresh arrays with its entries."""
    from jaxserve.sample.metadata import is_constant_array

    plain = make_sampling_metadata([_row(), None], num_rows=2, max_model_len=M)
    for a in (plain.logit_bias_ids, plain.logit_bias_values, plain.suppress_ids):
        assert is_constant_array(a) and not a.flags.writeable
    assert not plain.logit_bias_ids.any() and (plain.suppress_ids == -1).all()
    row = SamplingRow(SamplingParams(min_tokens=2, stop_token_ids=[11]), seed=0, output_pos=1,
                      prompt_token_ids=[3], output_token_ids=[5], eos_token_ids=(2,))
    md = make_sampling_metadata([_row({4: 1.0}), row], num_rows=2, max_model_len=M)
    assert not any(map(is_constant_array, (md.logit_bias_ids, md.suppress_ids)))
    assert md.logit_bias_ids[0, 0] == 4 and md.logit_bias_values[0, 0] == 1.0
    assert md.suppress_ids[1, :2].tolist() == [11, 2] and (md.suppress_ids[0] == -1).all()


@pytest.mark.parametrize("bias,msg", [
    ({"5": 100.5}, "logit_bias[5]=100.5: the bias must be a number in [-100, 100]"),
    ({5: -101}, "logit_bias[5]=-101: the bias must be a number in [-100, 100]"),
    ({5: math.nan}, "logit_bias[5]=nan"),
    ({5: "1"}, "logit_bias[5]='1'"),
    ({"abc": 1.0}, "logit_bias['abc']='abc': each key must be a token id (an integer)"),
    ({"-1": 1.0}, "logit_bias[-1]=-1: the key must be a token id in [0, 2**31="),
    ({"5": 1.0, 5: 2.0}, "token id 5 is given twice"),
    ({i: 1.0 for i in range(301)}, "logit_bias=<301 entries>: at most 300 entries"),
    ([1, 2], "logit_bias=[1, 2]: must map token ids to biases"),
])
def test_model_free_limits(bias, msg):
    with pytest.raises(ValidationError) as e:
        SamplingParams(logit_bias=bias)
    assert msg in str(e.value) and e.value.param == "logit_bias"


def test_vocab_limit_and_the_300_entry_edge():
    lim = Limits(vocab_size=V, max_model_len=M)
    p = SamplingParams(logit_bias={str(i): -100.0 if i % 2 else 100 for i in range(300)})
    with pytest.raises(ValidationError, match=r"logit_bias\[67\]=67: the key must be a token "
                                              r"id in \[0, vocab_size=67\)"):
        validate_sampling_params(p, lim)
    ok = SamplingParams(logit_bias={str(i): 1.0 for i in range(V)})
    assert validate_sampling_params(ok, lim) is ok and hash(ok) == hash(ok.replace())


def test_bias_forces_tokens_without_a_compile_after_warmup():
    engine = tiny_engine()
    st0 = engine.runner.stats()
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]

    def run(params):
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(f"lb{i}", p, sp)
        outs = {}
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o for o in engine.step() if o.finished})
        return [outs[f"lb{i}"].outputs[0].token_ids for i in range(len(prompts))]

    base = run([plain] * 3)
    forced = plain.replace(logit_bias={"40": 100.0})
    banned = plain.replace(logit_bias={str(t): -100.0 for t in set(base[2])})
    mixed = run([forced, plain, banned])
    assert mixed[0] == [40] * 6  # +100 beats any tiny-model logit gap
    assert mixed[1] == base[1]  # a plain row in a biased batch is unchanged
    assert not set(mixed[2]) & set(base[2])
    st = engine.runner.stats()
    assert st.late_compiles == st0.late_compiles
    assert (st.programs_built, st.programs_loaded) == (st0.programs_built, st0.programs_loaded)
