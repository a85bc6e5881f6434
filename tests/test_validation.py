"""The one validator (jaxserve/validation.py): every SamplingParams field, each bound, each message.

Expected messages are written out by hand from the rules' documented limits
(vLLM's ranges, the int32 storage of the sampler arrays, float32 rounding).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from jaxserve.sampling_params import SamplingParams
from jaxserve.validation import (INT32_MAX, SEED_MAX, Limits, Range, ValidationError, run_rules,
                                 validate_prompt, validate_sampling_params)

LIM = Limits(vocab_size=67, max_model_len=256, max_logprobs=5)

# (kwargs, field, a substring of the limit text)
BAD = [
    (dict(n=0), "n", "in [1, 16]"),
    (dict(n=17), "n", "in [1, 16]"),
    (dict(n=True), "n", "must be an int"),
    (dict(n=2.0), "n", "must be an int"),
    (dict(max_tokens=0), "max_tokens", ">= 1 or null"),
    (dict(max_tokens=2**31), "max_tokens", f"<= {INT32_MAX} (int32)"),
    (dict(max_tokens="5"), "max_tokens", "must be an int"),
    (dict(min_tokens=-1), "min_tokens", ">= 0"),
    (dict(min_tokens=2**40, max_tokens=None), "min_tokens", "(int32)"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens", "<= max_tokens=4"),
    (dict(temperature=-0.1), "temperature", "in [0.0, 100.0]"),
    (dict(temperature=math.nan), "temperature", "finite"),
    (dict(temperature=math.inf), "temperature", "finite"),
    (dict(temperature=None), "temperature", "must be a number"),
    (dict(top_k=-2), "top_k", ">= -1"),
    (dict(top_k=1.5), "top_k", "must be an int"),
    (dict(top_p=0.0), "top_p", "in (0.0, 1.0]"),
    (dict(top_p=1e-50), "top_p", "0.0 as float32"),
    (dict(top_p=1.0000001), "top_p", "in (0.0, 1.0]"),
    (dict(min_p=-1e-9), "min_p", "in [0.0, 1.0]"),
    (dict(repetition_penalty=0.0), "repetition_penalty", "(0.0, 10.0]"),
    (dict(repetition_penalty=1e-46), "repetition_penalty", "float32"),
    (dict(presence_penalty=2.5), "presence_penalty", "[-2.0, 2.0]"),
    (dict(frequency_penalty=-math.inf), "frequency_penalty", "finite"),
    (dict(seed=-1), "seed", f"[0, {SEED_MAX}]"),
    (dict(seed=2**63), "seed", f"[0, {SEED_MAX}]"),
    (dict(seed=SEED_MAX, n=2), "seed", "seed + n - 1"),
    (dict(stop=("",)), "stop[0]", "non-empty string"),
    (dict(stop=("ok", "x" * 257)), "stop[1]", "at most 256 characters"),
    (dict(stop=tuple("abcdefghijklmnopq")), "stop", "at most 16 strings"),
    (dict(stop_token_ids=(1, -1)), "stop_token_ids[1]", "[0, 2**31"),
    (dict(stop_token_ids=(2**40,)), "stop_token_ids[0]", "[0, 2**31"),
    (dict(stop_token_ids=(True,)), "stop_token_ids[0]", "token id"),
    (dict(stop_token_ids=tuple(range(17))), "stop_token_ids", "at most 16 ids"),
    (dict(ignore_eos=1), "ignore_eos", "true or false"),
    (dict(logprobs=-1), "logprobs", ">= 0 or null"),
    (dict(include_stop_str_in_output="yes"), "include_stop_str_in_output", "true or false"),
    (dict(skip_special_tokens=None), "skip_special_tokens", "true or false"),
]


@pytest.mark.parametrize("kw,field,limit", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_field_names_field_value_and_limit(kw, field, limit):
    with pytest.raises(ValidationError) as ei:
        SamplingParams(**kw)
    e = ei.value
    assert e.field == field and e.param == field.split("[")[0]
    assert str(e).startswith(f"{field}=") and limit in str(e), str(e)


def test_every_sampling_field_has_a_rule():
    import dataclasses

    from jaxserve.validation import SAMPLING_RULES

    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert fields <= {r.field for r in SAMPLING_RULES}


# (kwargs, field, limit) that only the model's limits reject.
MODEL_BAD = [
    (dict(stop_token_ids=(66, 67)), "stop_token_ids[1]", "[0, vocab_size=67)"),
    (dict(max_tokens=257), "max_tokens", "<= max_model_len=256"),
    (dict(min_tokens=257, max_tokens=None), "min_tokens", "<= max_model_len=256"),
    (dict(logprobs=6), "logprobs", "<= max_logprobs=5"),
]


@pytest.mark.parametrize("kw,field,limit", MODEL_BAD)
def test_model_limits(kw, field, limit):
    p = SamplingParams(**kw)  # fine without a model
    with pytest.raises(ValidationError, match=rf"^{field.replace('[', '.').replace(']', '.')}="):
        validate_sampling_params(p, LIM)
    with pytest.raises(ValidationError) as ei:
        validate_sampling_params(p, LIM)
    assert limit in str(ei.value)


@pytest.mark.parametrize("k,want", [(0, 0), (-1, -1), (1, 1), (66, 66), (67, 0), (2**31, 0),
                                    (2**40, 0), (10**30, 0)])
def test_top_k_at_or_beyond_vocab_is_off(k, want):
    assert validate_sampling_params(SamplingParams(top_k=k), LIM).top_k == want


def test_good_params_pass_unchanged():
    p = SamplingParams(
        n=16, max_tokens=256, min_tokens=3, temperature=100.0, top_k=66, top_p=1e-6, min_p=1.0,
        repetition_penalty=10.0, presence_penalty=-2.0, frequency_penalty=2.0,
        seed=SEED_MAX - 15, stop=("x" * 256,), stop_token_ids=tuple(range(51, 67)), logprobs=5)
    assert validate_sampling_params(p, LIM) == p
    # NumPy scalars are ints/floats too (LLM.generate users pass them).
    q = SamplingParams(max_tokens=np.int64(4), temperature=np.float32(0.5),
                       stop_token_ids=(np.int32(3),))
    assert validate_sampling_params(q, LIM) == q


def test_prompt_validation():
    validate_prompt([0, 66], LIM)
    for ids, msg in [([], "prompt is empty"), ([3, 67], "prompt[1]=67: must be a token id in "
                                                         "[0, vocab_size=67)"),
                     ([3, -1], "prompt[1]=-1"), ([1] * 256, "prompt=<256 tokens>: prompt length "
                                                            "256 must be < max_model_len=256")]:
        with pytest.raises(ValidationError) as ei:
            validate_prompt(ids, LIM)
        assert msg in str(ei.value) and ei.value.param == "prompt"


def test_rules_compose_for_new_fields():
    """A new body field (issue 17) is one more rule run by the same `run_rules`."""
    class Body:
        priority = 2**63

    with pytest.raises(ValidationError, match=r"^priority=9223372036854775808: must be an int in "):
        run_rules(Body(), (Range("priority", int, -(2**63), 2**63 - 1),))


def test_long_values_are_quoted_short():
    with pytest.raises(ValidationError) as ei:
        SamplingParams(stop=("x" * 1000,))
    assert len(str(ei.value)) < 200
