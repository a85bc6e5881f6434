"""The official `openai` client against the live server: completions and chat, both modes."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from .helpers import MODEL, fake_only


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)


@pytest.fixture
def aclient(server):
    return openai.AsyncOpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)


def _stream_text(stream) -> tuple[dict[int, str], dict[int, str], list]:
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = []
    for chunk in stream:
        if chunk.usage is not None:
            usage.append(chunk.usage)
        for ch in chunk.choices:
            piece = ch.text if hasattr(ch, "text") else (ch.delta.content or "")
            texts[ch.index] = texts.get(ch.index, "") + piece
            if ch.finish_reason is not None:
                finish[ch.index] = ch.finish_reason
    return texts, finish, usage


@fake_only
def test_completion_greedy_hand_checked(client):
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=5, temperature=0)
    assert r.choices[0].text == "defgh"
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 5, 8)
    assert r.model == MODEL and r.object == "text_completion"


def test_streamed_text_concatenates_to_non_streamed(client):
    kw = dict(model=MODEL, prompt="hello world", max_tokens=12, temperature=0)
    full = client.completions.create(**kw)
    texts, finish, usage = _stream_text(client.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    assert texts[0] == full.choices[0].text and finish[0] == full.choices[0].finish_reason
    assert len(usage) == 1 and usage[0] == full.usage


def test_chat_stream_matches_non_stream(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hi there"}], max_tokens=9,
              temperature=0)
    full = client.chat.completions.create(**kw)
    msg = full.choices[0].message
    assert msg.role == "assistant" and full.object == "chat.completion"
    texts, finish, usage = _stream_text(client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    assert texts[0] == msg.content and finish[0] == full.choices[0].finish_reason
    assert usage == [full.usage]
    assert full.usage.completion_tokens == 9 or full.choices[0].finish_reason == "stop"


@fake_only
def test_chat_prompt_tokens_include_template(client):
    full = client.chat.completions.create(model=MODEL, max_completion_tokens=2, temperature=0,
                                          messages=[{"role": "user", "content": "hi"}])
    # the tiny template: <s> "user hi" <s> "assistant " = 1 + 7 + 1 + 10 characters
    assert full.usage.prompt_tokens == 19
    assert full.choices[0].message.content == "ab"  # ' ' (3) + 1, + 2
    assert full.choices[0].finish_reason == "length"


@fake_only
def test_n2_with_seed_is_reproducible_and_hand_checked(client):
    kw = dict(model=MODEL, prompt="a", max_tokens=3, temperature=0.8, seed=3, n=2)
    r1 = client.completions.create(**kw)
    r2 = client.completions.create(**kw)
    assert [c.index for c in r1.choices] == [0, 1]
    # steps 2 + (3 + i) % 5 = 5 and 6 from 'a' (4)
    assert [c.text for c in r1.choices] == ["fkp", "gms"]
    assert [c.text for c in r2.choices] == [c.text for c in r1.choices]
    assert r1.usage.completion_tokens == 6 and r1.usage.prompt_tokens == 1


def test_n2_streaming_usage_sums_choices(client):
    kw = dict(model=MODEL, prompt="seed", max_tokens=7, temperature=0.7, seed=11, n=2,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    texts, finish, usage = _stream_text(client.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    assert texts == {c.index: c.text for c in full.choices}
    assert usage == [full.usage] and full.usage.completion_tokens == 14


@fake_only
def test_stop_string_both_modes(client):
    kw = dict(model=MODEL, prompt="a", max_tokens=10, temperature=0, stop=["ef", "zz"])
    full = client.completions.create(**kw)
    assert full.choices[0].text == "bcd" and full.choices[0].finish_reason == "stop"
    assert full.usage.completion_tokens == 5  # b c d e f were generated
    texts, finish, _ = _stream_text(client.completions.create(**kw, stream=True))
    assert texts[0] == "bcd" and finish[0] == "stop"
    incl = client.completions.create(**kw, extra_body={"include_stop_str_in_output": True})
    assert incl.choices[0].text == "bcdef"


@fake_only
def test_vllm_extra_fields(client):
    r = client.completions.create(model=MODEL, prompt=[66], max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"
    r = client.completions.create(model=MODEL, prompt=[66], max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "stop"  # 0 1 EOS=2
    r = client.completions.create(model=MODEL, prompt="a", max_tokens=9, temperature=0,
                                  extra_body={"stop_token_ids": [7]})  # 7 = "d"
    assert r.choices[0].text == "bc" and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == 7


@fake_only
def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="a", max_tokens=2, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == ["b", "c"]
    assert lp.token_logprobs == pytest.approx([-0.1, -0.1])
    assert lp.top_logprobs[0] == pytest.approx({"b": -0.1, "c": -1.1, "d": -2.1})
    assert lp.text_offset == [0, 1]


@fake_only
def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=1, temperature=0, logprobs=True, top_logprobs=1)
    content = r.choices[0].logprobs.content
    # the template ends in " " (3), so greedy counting gives "a" (4)
    assert len(content) == 1 and content[0].token == "a" and content[0].logprob == pytest.approx(-0.1)
    assert [t.token for t in content[0].top_logprobs] == ["a"]
    assert content[0].bytes == [97]


@fake_only
def test_token_id_prompts_and_prompt_lists(client):
    r = client.completions.create(model=MODEL, prompt=[[4], [27]], max_tokens=2, temperature=0,
                                  n=2)  # "a", "x"
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == ["bc", "bc", "yz", "yz"]
    assert r.usage.prompt_tokens == 2 and r.usage.completion_tokens == 8
    r = client.completions.create(model=MODEL, prompt=["ab", "xyz"], max_tokens=1, temperature=0)
    assert [c.text for c in r.choices] == ["c", "A"] and r.usage.prompt_tokens == 5  # z (29) + 1


@fake_only
def test_echo(client):
    r = client.completions.create(model=MODEL, prompt="ab", max_tokens=2, temperature=0, echo=True)
    assert r.choices[0].text == "abcd"
    texts, _, _ = _stream_text(client.completions.create(model=MODEL, prompt="ab", max_tokens=2,
                                                         temperature=0, echo=True, stream=True))
    assert texts[0] == "abcd"


def test_models_endpoint(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    health = httpx.get(server.url("/health")).json()
    total = len(server.engine.bucket_policy.program_keys(  # every program ready
        score=server.engine.config.enable_prompt_logprobs))
    assert health == {"status": "ok", "programs_ready": total, "programs_total": total,
                      "warmup_done": True, "paused": False, "pause_mode": None,
                      "is_sleeping": False}


def test_async_client_concurrent_requests_all_complete(aclient):
    async def main():
        async def one(i):
            r = await aclient.completions.create(model=MODEL, prompt=f"p{i}", max_tokens=4 + i % 5,
                                                 temperature=0, extra_body={"ignore_eos": True})
            return r.usage.completion_tokens, 4 + i % 5
        return await asyncio.gather(*(one(i) for i in range(24)))

    for got, want in asyncio.run(main()):
        assert got == want
