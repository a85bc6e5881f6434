"""logit_bias over HTTP (both endpoints, official `openai` client): 400s naming the field
and the limit; on the tiny engine, a +100 bias forces the token (vocab ids in helpers.py)."""

from __future__ import annotations

import httpx
import openai
import pytest

from .helpers import ENGINE_KIND, MODEL, healthy_probe

CHAT_MSG = [{"role": "user", "content": "ab"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)


@pytest.mark.parametrize("bias,msg", [
    ({"5": 100.5}, "logit_bias[5]=100.5: the bias must be a number in [-100, 100]"),
    ({"67": 1}, "logit_bias[67]=67: the key must be a token id in [0, vocab_size=67)"),
    ({"x": 1}, "logit_bias['x']='x': each key must be a token id (an integer)"),
    ({str(i): 1 for i in range(301)}, "at most 300 entries"),
])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_bad_logit_bias_is_a_400(server, route, bias, msg):
    body = {"model": MODEL, "max_tokens": 2, "logit_bias": bias}
    body.update({"prompt": "ab"} if route == "/v1/completions" else {"messages": CHAT_MSG})
    r = httpx.post(server.url(route), json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "logit_bias" and msg in err["message"], err
    healthy_probe(server)


def test_logit_bias_is_accepted_and_on_the_tiny_engine_forces_the_token(client):
    # id 40 is 'K' in the tiny vocabulary (30..55 A-Z).
    c = client.completions.create(model=MODEL, prompt="ab", max_tokens=4, temperature=0,
                                  logit_bias={"40": 100})
    ch = client.chat.completions.create(model=MODEL, messages=CHAT_MSG, max_tokens=4,
                                        temperature=0, logit_bias={"40": 100})
    if ENGINE_KIND == "tiny":
        assert c.choices[0].text == "KKKK" and ch.choices[0].message.content == "KKKK"
    else:  # the fake's counting tokens ignore logits: only the plumbing is checked
        assert c.usage.completion_tokens == 4 and ch.usage.completion_tokens == 4
