"""Issue 13 through HTTP, on both endpoints, streamed and not.

* Fix 4: `stream_options` without `stream: true` is a 400 naming stream_options
  (OpenAI and vLLM answer 400); it failed before the fix (HTTP 200).
* Fix 3: the stopping token's text (EOS with skip_special_tokens=False, a stop
  token id) is not in the output unless include_stop_str_in_output; expected
  texts come from the fake runner's counting arithmetic (helpers.py) and the
  tokenizer's own decode.
* Fixes 1-2 at the server: top_k beyond the vocabulary is "no top-k" (same
  text as top_k=0 with the same seed), an out-of-vocab stop id is a 400 naming
  the field and vocab_size.
"""

from __future__ import annotations

import httpx
import pytest

from conftest import tiny_tokenizer

from .helpers import MODEL, fake_only, healthy_probe
from .test_cases import sse_events

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
ROUTES = [CMPL, CHAT]


def _body(route: str, **kw) -> dict:
    if route == CMPL:
        return {"model": MODEL, "prompt": "abc", "max_tokens": 6, **kw}
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, **kw}


def _text(route: str, srv, body: dict, stream: bool) -> tuple[str, str, object]:
    """(text, finish_reason, stop_reason) of choice 0, from JSON or from the SSE deltas."""
    r = httpx.post(srv.url(route), json={**body, "stream": stream}, timeout=30)
    assert r.status_code == 200, r.text
    if not stream:
        c = r.json()["choices"][0]
        return (c["text"] if route == CMPL else c["message"]["content"], c["finish_reason"],
                c.get("stop_reason"))
    text, finish, stop = "", None, None
    for ev in sse_events(r.text):
        if ev == "[DONE]" or not ev["choices"]:
            continue
        c = ev["choices"][0]
        text += c["text"] if route == CMPL else c["delta"].get("content", "")
        finish = c["finish_reason"] or finish
        stop = c.get("stop_reason", stop) if c["finish_reason"] else stop
    return text, finish, stop


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("opts", [{"include_usage": True}, {}])
@pytest.mark.parametrize("stream_field", [{"stream": False}, {}], ids=["false", "omitted"])
def test_stream_options_without_stream_is_400(server, route, opts, stream_field):
    body = {k: v for k, v in _body(route, stream_options=opts).items()}
    body.update(stream_field)
    r = httpx.post(server.url(route), json=body, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "stream_options" and "stream" in err["message"]
    ok = httpx.post(server.url(route), json={**body, "stream": True}, timeout=30)
    assert ok.status_code == 200 and ok.text.rstrip().endswith("data: [DONE]")
    healthy_probe(server)


@fake_only
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("route", ROUTES)
def test_eos_text_is_left_out(server, route, stream):
    tok = tiny_tokenizer()
    if route == CMPL:
        # Greedy counting from "9" (id 65): <unk> (66), <pad> (0), <s> (1), then EOS (2).
        body, ids = _body(CMPL, prompt="x9", temperature=0, max_tokens=10), [66, 0, 1]
    else:
        # Seed 4 steps by 2 + 4 % 5 = 6 from the template's last token ' ' (3): 9, 15, ...,
        # 63, then (63 + 6) % 67 = 2 = EOS after 10 tokens.
        body, ids = _body(CHAT, temperature=1.0, seed=4, max_tokens=20), list(range(9, 64, 6))
    body["skip_special_tokens"] = False
    text, finish, _ = _text(route, server, body, stream)
    assert finish == "stop"
    assert text == tok.decode(ids, skip_special_tokens=False) and not text.endswith("</s>")
    text, _, _ = _text(route, server, {**body, "include_stop_str_in_output": True}, stream)
    assert text == tok.decode(ids + [2], skip_special_tokens=False) and text.endswith("</s>")


@fake_only
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_stop_token_id_text_is_left_out(server, stream):
    g = tiny_tokenizer().encode("g", add_special_tokens=False)[0]
    body = _body(CMPL, temperature=0, stop_token_ids=[g], max_tokens=10)  # "abc" -> "defg..."
    assert _text(CMPL, server, body, stream) == ("def", "stop", g)
    inc = {**body, "include_stop_str_in_output": True}
    assert _text(CMPL, server, inc, stream) == ("defg", "stop", g)


@fake_only
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_the_stop_string_that_ends_first_wins(server, stream):
    # Issue 30 item 1 (vLLM's rule): "abc" -> "defg...": on the token "g" both "defg" and
    # "g" complete, both ending at 'g'; the tie goes to the earlier in the list. The old
    # rule (earliest start) said "defg" for both orders.
    body = _body(CMPL, temperature=0, max_tokens=10, stop=["g", "defg"])
    assert _text(CMPL, server, body, stream)[0] == "def"
    assert _text(CMPL, server, {**body, "include_stop_str_in_output": True}, stream)[0] == "defg"
    r = httpx.post(server.url(CMPL), json=body, timeout=30).json()["choices"][0]
    assert (r["finish_reason"], r["stop_reason"]) == ("stop", "g")
    r = httpx.post(server.url(CMPL), json={**body, "stop": ["defg", "g"]}, timeout=30).json()
    assert (r["choices"][0]["text"], r["choices"][0]["stop_reason"]) == ("", "defg")


@pytest.mark.parametrize("route", ROUTES)
def test_top_k_beyond_vocab_is_no_top_k(server, route):
    body = _body(route, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    want = _text(route, server, {**body, "top_k": 0}, False)
    for k in (server.engine.config.model.vocab_size, 2**31, 2**40, 10**30):
        assert _text(route, server, {**body, "top_k": k}, False) == want, k


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_out_of_vocab_stop_token_id_is_400(server, route, stream):
    V = server.engine.config.model.vocab_size
    for bad in (V, 2**40):
        r = httpx.post(server.url(route), json=_body(route, stop_token_ids=[3, bad],
                                                     stream=stream), timeout=10)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "stop_token_ids"
        assert err["message"].startswith(f"stop_token_ids[1]={bad}: must be a token id in [0, ")
    assert f"vocab_size={V}" in httpx.post(server.url(route), json=_body(
        route, stop_token_ids=[V])).json()["error"]["message"]
    healthy_probe(server)
