"""prompt_logprobs (vLLM's extra field) and echo with logprobs (OpenAI) on /v1/completions,
both through the engine's scoring path.

Expected values: with the fake engine, `jaxserve.worker.scoring.fake_scores` (prompt token t
scores -0.1 * (1 + t % 5); alternative i is (t + i) % V at -(0.1 + i)); with the tiny
engine (JAXSERVE_SERVER_TEST_ENGINE=tiny), a float64 log_softmax of the model's plain
full-sequence forward (`reference_logits`).
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from conftest import tiny_tokenizer
from jaxserve.config import ModelConfig

from .helpers import ENGINE_KIND, MODEL, fake_engine, healthy_probe, running_server

PROMPT = [4, 5, 6, 7, 8, 9, 10]  # "abcdefg" in the tiny vocabulary
V = ModelConfig.tiny().vocab_size


def expected(server, ids: list[int], k: int) -> list[dict[int, float] | None]:
    """vLLM's prompt_logprobs list for `ids`: None, then {token: lp, top-k alternatives}."""
    out: list[dict[int, float] | None] = [None]
    if ENGINE_KIND == "fake":
        for t in ids[1:]:
            e = {(t + i) % V: -(0.1 + i) for i in range(1, k + 1)}
            e[t] = -0.1 * (1 + t % 5)
            out.append(e)
        return out
    from jaxserve.model.llama import reference_logits

    eng = server.engine
    x = reference_logits(eng.config.model, eng.runner.params, np.array(ids)).astype(np.float64)
    lp = x - x.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    for j in range(1, len(ids)):
        e = {int(t): float(lp[j - 1, t]) for t in np.argsort(-lp[j - 1])[:k]}
        e[ids[j]] = float(lp[j - 1, ids[j]])
        out.append(e)
    return out


def post(server, **body):
    return httpx.post(server.url("/v1/completions"), json={"model": MODEL, **body}, timeout=60)


def _sse(server, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_prompt_logprobs_field(server):
    r = post(server, prompt=PROMPT, max_tokens=2, temperature=0, prompt_logprobs=2)
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["prompt_logprobs"]
    want = expected(server, PROMPT, 2)
    assert len(got) == len(PROMPT) and got[0] is None
    tok = tiny_tokenizer()
    for g, w in zip(got[1:], want[1:]):
        assert {int(t) for t in g} == set(w)
        for t, v in g.items():
            assert v["logprob"] == pytest.approx(w[int(t)], abs=1e-4)
            assert v["decoded_token"] == tok.decode([int(t)])
    # Without the field, the choice has none.
    r = post(server, prompt=PROMPT, max_tokens=2, temperature=0)
    assert "prompt_logprobs" not in r.json()["choices"][0]


def test_echo_with_logprobs_prepends_the_prompt(server):
    r = post(server, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=1, n=2)
    assert r.status_code == 200, r.text
    want = expected(server, PROMPT, 1)
    tok = tiny_tokenizer()
    text_prompt = tok.decode(PROMPT)
    for ch in r.json()["choices"]:
        lp = ch["logprobs"]
        assert ch["text"].startswith(text_prompt)
        assert len(lp["tokens"]) == len(PROMPT) + 3
        assert lp["tokens"][:len(PROMPT)] == [tok.decode([t]) for t in PROMPT]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for j in range(1, len(PROMPT)):
            assert lp["token_logprobs"][j] == pytest.approx(want[j][PROMPT[j]], abs=1e-4)
            assert len(lp["top_logprobs"][j]) <= 2  # the token itself + 1 alternative
        offs = lp["text_offset"]
        assert offs[:len(PROMPT)] == list(range(len(PROMPT)))  # one character per token
        assert offs == sorted(offs)


def test_streamed_echo_with_logprobs_comes_first(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "echo": True,
            "logprobs": 0, "stream": True}
    chunks = _sse(server, body)
    first = chunks[0]["choices"][0]
    tok = tiny_tokenizer()
    assert first["text"] == tok.decode(PROMPT)
    assert first["logprobs"]["tokens"] == [tok.decode([t]) for t in PROMPT]
    want = expected(server, PROMPT, 0)
    assert first["logprobs"]["token_logprobs"][0] is None
    np.testing.assert_allclose(first["logprobs"]["token_logprobs"][1:],
                               [want[j][PROMPT[j]] for j in range(1, len(PROMPT))], atol=1e-4)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]).startswith(
        tok.decode(PROMPT))


@pytest.mark.parametrize("body,param,msg", [
    ({"prompt_logprobs": -1}, "prompt_logprobs", "prompt_logprobs=-1: must be an int >= 0"),
    ({"prompt_logprobs": 21}, "prompt_logprobs", "prompt_logprobs=21: must be <= max_logprobs=20"),
    ({"prompt_logprobs": "x"}, "prompt_logprobs", ""),
    ({"echo": True, "logprobs": 21}, "logprobs", "[0, 20]"),
])
def test_bad_prompt_logprobs_are_400s(server, body, param, msg):
    r = post(server, prompt=PROMPT, max_tokens=1, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and msg in err["message"], err
    healthy_probe(server)


def test_scoring_off_names_the_flag():
    with running_server(fake_engine(enable_prompt_logprobs=False)) as srv:
        for body, param in (({"prompt_logprobs": 1}, "prompt_logprobs"),
                            ({"echo": True, "logprobs": 1}, "echo")):
            r = post(srv, prompt=PROMPT, max_tokens=1, **body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == param and "--enable_prompt_logprobs" in err["message"], err
        r = post(srv, prompt=PROMPT, max_tokens=1, echo=True)  # echo alone needs no scores
        assert r.status_code == 200


def test_echo_with_max_tokens_0_returns_the_prompt_alone(server):
    # Issue 30 item 2 (vLLM's echo_without_generation): lm-eval's loglikelihood request.
    tok = tiny_tokenizer()
    want = expected(server, PROMPT, 1)
    for prompt in (PROMPT, tok.decode(PROMPT)):  # token ids and text
        r = post(server, prompt=prompt, max_tokens=0, echo=True, logprobs=1, n=2)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 0,
                                 "total_tokens": len(PROMPT)}
        for ch in body["choices"]:
            assert ch["text"] == tok.decode(PROMPT) and ch["finish_reason"] == "length"
            lp = ch["logprobs"]
            assert lp["tokens"] == [tok.decode([t]) for t in PROMPT]
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            np.testing.assert_allclose(lp["token_logprobs"][1:],
                                       [want[j][PROMPT[j]] for j in range(1, len(PROMPT))],
                                       atol=1e-4)
    # Without logprobs: the text alone; streamed: the same choice, usage 0 completion tokens.
    r = post(server, prompt=PROMPT, max_tokens=0, echo=True)
    assert r.json()["choices"][0]["text"] == tok.decode(PROMPT)
    assert r.json()["choices"][0]["logprobs"] is None
    chunks = _sse(server, {"model": MODEL, "prompt": PROMPT, "max_tokens": 0, "echo": True,
                           "logprobs": 0, "stream": True,
                           "stream_options": {"include_usage": True}})
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(c["text"] for c in choices) == tok.decode(PROMPT)
    assert choices[-1]["finish_reason"] == "length"
    assert sum(len(c["logprobs"]["tokens"]) for c in choices) == len(PROMPT)
    assert chunks[-1]["usage"]["completion_tokens"] == 0
    healthy_probe(server)


def test_max_tokens_0_without_echo_stays_a_400(server):
    r = post(server, prompt=PROMPT, max_tokens=0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "max_tokens" in r.json()["error"]["message"]
