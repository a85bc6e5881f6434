"""`logprobs_mode` of the sampler (issue 15; vLLM's raw vs processed logprobs) against a
float64 NumPy reference: processed logprobs are those of the distribution sampled from
(penalties, min_tokens suppression, temperature, top-k, top-p, min-p)."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from jaxserve.sample.sampler import sample
from sample.test_sampler import NLP, S, _log_softmax64, _logits, _md, _ref_penalties, _ref_probs, _row

PROMPT, OUT = (1, 2, 3), (4, 5, 5)
# (sampling kwargs) per row; rows past the list are padding (greedy).
SPECS = [
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=5),
    dict(temperature=0.9, top_p=0.6),
    dict(temperature=1.0, min_p=0.2),
    dict(temperature=0.5, top_k=8, top_p=0.8, repetition_penalty=1.4, presence_penalty=0.5,
         frequency_penalty=0.3),
    dict(temperature=0.0, repetition_penalty=1.5),  # greedy: penalties only
    dict(temperature=2.0, top_k=3, min_tokens=5, stop_token_ids=(7,)),  # 7 and EOS 2 suppressed
]


def _reference(logits_row, spec):
    """float64 log-probabilities of the distribution the row samples from."""
    x = _ref_penalties(logits_row, PROMPT, OUT, spec.get("repetition_penalty", 1.0),
                       spec.get("presence_penalty", 0.0), spec.get("frequency_penalty", 0.0))
    if spec.get("min_tokens", 0) > len(OUT):
        x[list(spec.get("stop_token_ids", ())) + [2]] = -np.inf
    if spec["temperature"] == 0.0:
        return _log_softmax64(x)
    with np.errstate(divide="ignore"):
        return np.log(_ref_probs(x, spec["temperature"], spec.get("top_k", 0),
                                 spec.get("top_p", 1.0), spec.get("min_p", 0.0)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_processed_and_raw_logprobs_match_numpy(seed):
    logits = _logits(seed, scale=3.0)
    rows = [_row(seed=seed * 100 + i, prompt=PROMPT, out=OUT, eos=(2,), **sp)
            for i, sp in enumerate(SPECS)]
    md = _md(rows)
    raw = jax.jit(functools.partial(sample, max_logprobs=NLP))(logits, md)
    proc = jax.jit(functools.partial(sample, max_logprobs=NLP,
                                     logprobs_mode="processed_logprobs"))(logits, md)
    # The mode changes what is reported, never what is sampled.
    np.testing.assert_array_equal(np.asarray(raw.token_ids), np.asarray(proc.token_ids))
    tok = np.asarray(proc.token_ids)
    np.testing.assert_allclose(raw.logprobs, _log_softmax64(logits)[np.arange(S), tok],
                               rtol=1e-5, atol=1e-5)
    for i, spec in enumerate(SPECS):
        ref = _reference(logits[i], spec)
        assert np.isfinite(ref[tok[i]]), (i, spec)  # the sampled id was allowed
        np.testing.assert_allclose(proc.logprobs[i], ref[tok[i]], rtol=1e-5, atol=1e-5)
        top = np.sort(ref)[::-1][:NLP]
        got = np.asarray(proc.top_logprobs[i])
        np.testing.assert_array_equal(np.isinf(got), np.isinf(top))  # filtered ids: -inf
        fin = np.isfinite(top)
        np.testing.assert_allclose(got[fin], top[fin], rtol=1e-5, atol=1e-5)
    assert not np.allclose(raw.logprobs[:len(SPECS)], proc.logprobs[:len(SPECS)])


def test_unknown_logprobs_mode_raises():
    with pytest.raises(ValueError, match="logprobs_mode='raw_logits'"):
        sample(_logits(0), _md([]), max_logprobs=0, logprobs_mode="raw_logits")
