"""`--stream_interval k` (vLLM's): several tokens share one SSE event, the first and the
last at once; the streamed text, tokens and logprobs are those of k = 1. (The engine
emits outputs of 1, 4, 4, 1 tokens here; the server's output collector may merge
consecutive ones when the stream lags, so an event ends where one of them ends.)"""

from __future__ import annotations

import itertools

import openai

from .helpers import MODEL, fake_engine, running_server


def _chunks(client, **kw) -> list:
    return [c for c in client.completions.create(model=MODEL, stream=True, **kw) if c.choices]


def test_sse_events_carry_k_tokens_each_and_the_same_text():
    kw = dict(prompt="abc", max_tokens=10, temperature=0, logprobs=1)
    got = {}
    for k in (1, 4):
        with running_server(fake_engine(stream_interval=k)) as srv:
            client = openai.OpenAI(base_url=srv.url("/v1"), api_key="unused", max_retries=0)
            got[k] = _chunks(client, **kw)
    # The counting fake continues "abc" one letter a token: "defghijklm" (hand-checked).
    for k in (1, 4):
        assert "".join(c.choices[0].text for c in got[k]) == "defghijklm"
        assert sum((c.choices[0].logprobs.tokens for c in got[k]), []) == list("defghijklm")
        assert got[k][-1].choices[0].finish_reason == "length"
    sizes = [len(c.choices[0].logprobs.tokens) for c in got[4] if c.choices[0].logprobs]
    assert set(itertools.accumulate(sizes)) <= {1, 5, 9, 10} and len(sizes) <= 4
    assert sum(len(c.choices[0].logprobs.tokens) for c in got[1]) == 10
    assert sum((c.choices[0].logprobs.token_logprobs for c in got[4]), []) == \
        sum((c.choices[0].logprobs.token_logprobs for c in got[1]), [])
