"""Tool calling and reasoning over HTTP with the official `openai` client (issue 29).

Three servers:
- `grammar`: `tool_choice` required / named under the structured-output engine, on
  either engine kind (the FakeRunner obeys the grammar; the tiny real model samples
  under it), with a template that knows nothing of tools (as SmolLM2's). Each call is
  checked with `jsonschema` against its tool's schema.
- `scripted`: a FakeRunner that writes a fixed model output chosen by the prompt
  ("script N"), behind a hand-written hermes template (TOOL_TEMPLATE), with
  `--reasoning_parser=qwen3`: tool calls, malformed markup, reasoning; streamed
  deltas join to the non-streamed message. The template's rendering (tools,
  assistant tool_calls, tool results, reasoning_content, chat_template_kwargs) is
  compared with transformers' own `render_jinja_template`.
- `smollm2`: SmolLM2's real tokenizer and chat template (GGUF header, no weights):
  required / named / auto and a multi-turn agent conversation.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
from pathlib import Path

import httpx
import jsonschema
import numpy as np
import openai
import pytest

from conftest import char_tokenizer
from jaxserve.checkpoint.tokenizer import Tokenizer
from jaxserve.config import ModelConfig
from jaxserve.engine import LLMEngine, make_engine_config
from jaxserve.worker.fake_runner import FakeRunner, counting_token
from test_structured_output import so_engine

from .helpers import ENGINE_KIND, MODEL, healthy_probe, running_server

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather"}]

# A hermes-style template in the Qwen2.5 manner, one line (the ASCII tokenizer has no
# newline): tools as JSON, assistant calls as <tool_call> markup, thinking spans.
TOOL_TEMPLATE = (
    "{%- if tools %}{{ bos_token }}system Tools:{% for t in tools %} {{ t | tojson }}"
    "{% endfor %}{% endif %}"
    "{%- for m in messages %}{{ bos_token }}{{ m.role }}"
    "{%- if m.reasoning_content %} <think>{{ m.reasoning_content }}</think>{% endif %}"
    "{%- if m.content %} {{ m.content }}{% endif %}"
    "{%- for c in m.tool_calls or [] %} <tool_call>{{ {'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}"
    "{%- if m.tool_call_id %} for {{ m.tool_call_id }}{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}{{ bos_token }}assistant "
    "{%- if enable_thinking is defined and not enable_thinking %} <think></think>{% endif %}"
    "{% endif %}")

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>'
SCRIPTS = [
    "Sure. " + CALL,
    CALL + '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>',
    "<think>The user greets me.</think>Hello there",
    "<think>I need the forecast.</think>" + CALL,
    '<think>Plan: Paris.</think>{"city":"Paris","days":3}',  # a grammar after reasoning
]
GGUF = Path(__file__).resolve().parents[2] / "checkpoints" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.lru_cache(maxsize=None)
def tool_tokenizer() -> Tokenizer:
    """The printable-ASCII character tokenizer with TOOL_TEMPLATE."""
    base = char_tokenizer([chr(i) for i in range(32, 127)], unk=None)
    return Tokenizer(base._tok, bos_token="<s>", eos_token="</s>", chat_template=TOOL_TEMPLATE)


def _fake(tok, token_fn=None, **kw) -> LLMEngine:
    model = ModelConfig.tiny(vocab_size=tok.vocab_size,
                             max_position_embeddings=2048)
    args = dict(max_model_len=1024, block_size=4, num_kv_blocks=2000, max_num_seqs=16,
                max_num_batched_tokens=128)
    args.update(kw)
    config = make_engine_config(model, **args)
    runner = FakeRunner.for_config(
        config, token_fn=token_fn or counting_token(model.vocab_size, config.max_logprobs),
        step_delay=0.0005)
    return LLMEngine(config, tokenizer=tok, runner=runner, model_name=MODEL)


def _script_fn(tok):
    scripts = [tok.encode(s, add_special_tokens=False) for s in SCRIPTS]

    def fn(req, pos):  # the last "script N" in the prompt picks the output, then EOS
        prompt = tok.decode(req.prompt_token_ids)
        at = prompt.rfind("script ")
        out = scripts[int(prompt[at + 7])] if at >= 0 else []  # no script: EOS at once
        return out[pos] if pos < len(out) else tok.eos_token_id
    return fn


@pytest.fixture(scope="module")
def grammar():
    engine = so_engine() if ENGINE_KIND != "fake" else _fake(tool_tokenizer())
    with running_server(engine) as srv:
        yield srv, openai.OpenAI(base_url=srv.url("/v1"), api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def scripted():
    tok = tool_tokenizer()
    with running_server(_fake(tok, _script_fn(tok)), reasoning_parser="qwen3") as srv:
        yield srv, openai.OpenAI(base_url=srv.url("/v1"), api_key="none", max_retries=0)


def _check_calls(calls, *, one: str | None = None):
    assert calls, "no tool calls"
    for c in calls:
        assert c.type == "function" and c.id
        assert c.function.name in SCHEMAS if one is None else c.function.name == one
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


@pytest.mark.parametrize("tool_choice,parallel", [("required", False), ("required", True),
                                                  ("named", True)])
def test_forced_tool_calls_100_seeded_samples(grammar, tool_choice, parallel):
    """Every sample is valid calls. With parallel calls a model may keep appending calls
    (the counting FakeRunner always does) until max_tokens: finish_reason "length", the
    calls that closed before the cut kept."""
    srv, client = grammar
    tc = ("required" if tool_choice == "required"
          else {"type": "function", "function": {"name": "get_time"}})
    n = 4  # <= max_num_seqs; 25 requests with seeds 4k (sample i: seed 4k + i) at once

    def ask(k):
        return client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                              tool_choice=tc, n=n, seed=n * k, temperature=1.0,
                                              max_tokens=120, parallel_tool_calls=parallel).choices
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        choices = [c for cs in pool.map(ask, range(100 // n)) for c in cs]
    assert len(choices) == 100
    for ch in choices:
        assert ch.finish_reason == "tool_calls" or (parallel and ch.finish_reason == "length"), ch
        assert ch.message.content is None
        _check_calls(ch.message.tool_calls, one=None if tool_choice == "required" else "get_time")
        if not parallel:
            assert len(ch.message.tool_calls) == 1
    healthy_probe(srv)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function",
                                                      "function": {"name": "get_weather"}}])
def test_forced_call_streamed_joins_to_the_same_call(grammar, tool_choice):
    _, client = grammar
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, temperature=0,
              max_tokens=120, parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            assert not ch.delta.content, ch.delta  # no markup or JSON leaks into content
            for tc in ch.delta.tool_calls or ():
                if tc.id is not None:  # the first delta of a call: id, type and name
                    assert tc.type == "function" and tc.function.name
                    calls[tc.index] = {"name": tc.function.name, "arguments": ""}
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    assert finish == whole.finish_reason == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in whole.message.tool_calls]


def test_auto_and_none_answer_200(grammar):
    _, client = grammar
    for choice in ("auto", "none", None):
        kw = {} if choice is None else {"tool_choice": choice}
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=8,
                                           temperature=0, **kw)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_empty_assistant_and_tool_without_id_are_accepted(grammar):
    """vLLM accepts an assistant message with neither content nor tool calls, and a tool
    result without tool_call_id."""
    srv, _ = grammar
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant"},
                {"role": "tool", "content": "ok"}, {"role": "user", "content": "again"}]
    r = httpx.post(srv.url("/v1/chat/completions"), json={
        "model": MODEL, "messages": messages, "tools": TOOLS, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text


def _ask(n: int, **kw):
    return dict(model=MODEL, messages=[{"role": "user", "content": f"script {n}"}],
                max_tokens=200, temperature=0, **kw)


def _stream(client, *, leaks_ok=False, **kw):
    """(content, reasoning, calls, finish_reason) joined from a stream's deltas; no
    delta holds a piece of a tag (unless `leaks_ok`: malformed markup is content)."""
    content, reasoning, calls, finish = [], [], {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta
            content.append(d.content or "")
            assert getattr(d, "reasoning", None) == getattr(d, "reasoning_content", None)
            reasoning.append(getattr(d, "reasoning", None) or "")
            for tc in d.tool_calls or ():
                if tc.id is not None:
                    calls[tc.index] = [tc.function.name, ""]
                calls[tc.index][1] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    for piece in [] if leaks_ok else content + reasoning:
        assert "<tool" not in piece and "<think" not in piece and "</" not in piece, piece
    return "".join(content), "".join(reasoning), [calls[i] for i in sorted(calls)], finish


# (script, content, reasoning, [(name, arguments)], finish_reason)
SCRIPTED = [
    (0, "Sure. ", None, [("get_weather", {"city": "Paris", "days": 3})], "tool_calls"),
    (1, None, None, [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "UTC"})],
     "tool_calls"),
    (2, SCRIPTS[2], None, [], "stop"),  # malformed JSON: left as content, no 500
    (3, "Hello there", "The user greets me.", [], "stop"),
    (4, None, "I need the forecast.", [("get_weather", {"city": "Paris", "days": 3})],
     "tool_calls"),
]


@pytest.mark.skipif(ENGINE_KIND != "fake", reason="scripted FakeRunner outputs (one run)")
@pytest.mark.parametrize("script,content,reasoning,calls,finish", SCRIPTED)
def test_auto_parses_model_output(scripted, script, content, reasoning, calls, finish):
    srv, client = scripted
    r = client.chat.completions.create(tools=TOOLS, **_ask(script))
    ch = r.choices[0]
    assert ch.message.content == content
    assert ch.message.reasoning == ch.message.reasoning_content == reasoning
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in ch.message.tool_calls or ()] == calls
    assert ch.finish_reason == finish
    s_content, s_reasoning, s_calls, s_finish = _stream(client, tools=TOOLS, leaks_ok=script == 2,
                                                       **_ask(script))
    assert s_content == (content or "") and s_reasoning == (reasoning or "")
    assert [(n, json.loads(a)) for n, a in s_calls] == calls and s_finish == finish
    healthy_probe(srv)


@pytest.mark.skipif(ENGINE_KIND != "fake", reason="scripted FakeRunner outputs (one run)")
def test_no_parsing_without_tools_or_with_tool_choice_none(scripted):
    _, client = scripted
    for kw in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        ch = client.chat.completions.create(**_ask(0), **kw).choices[0]
        assert ch.message.content == SCRIPTS[0] and not ch.message.tool_calls
        assert ch.finish_reason == "stop"


def _conversation():
    """user -> assistant tool call (no content) -> tool result -> assistant -> user."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Lima", "days": 2}'}}
    return [{"role": "user", "content": "Weather in Lima"},
            {"role": "assistant", "content": None, "tool_calls": [call],
             "reasoning_content": "Use the tool."},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
            {"role": "assistant", "content": "It is sunny."},
            {"role": "user", "content": "Thanks, script 3"}]


@pytest.mark.skipif(ENGINE_KIND != "fake", reason="scripted FakeRunner outputs (one run)")
def test_rendering_matches_transformers(scripted):
    from transformers.utils.chat_template_utils import render_jinja_template

    srv, client = scripted
    messages = _conversation()
    ref_messages = json.loads(json.dumps(messages))  # transformers: arguments as an object
    ref_messages[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Lima", "days": 2}
    ref_messages[1]["content"] = ""
    for kwargs in ({}, {"enable_thinking": False}):
        ref, _ = render_jinja_template([ref_messages], tools=TOOLS, chat_template=TOOL_TEMPLATE,
                                       add_generation_prompt=True, bos_token="<s>",
                                       eos_token="</s>", **kwargs)
        body = {"model": MODEL, "messages": messages, "tools": TOOLS,
                "chat_template_kwargs": kwargs}
        r = httpx.post(srv.url("/tokenize"), json=body)
        assert r.status_code == 200, r.text
        assert tool_tokenizer().decode(r.json()["tokens"], skip_special_tokens=False) == ref[0]
        out = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                             max_tokens=50, extra_body={
                                                 "chat_template_kwargs": kwargs})
        assert out.usage.prompt_tokens == r.json()["count"]
        assert out.choices[0].message.content == "Hello there"


@pytest.fixture(scope="module")
def smollm2():
    if not GGUF.is_file():
        pytest.skip("SmolLM2 GGUF not downloaded")
    from jaxserve.checkpoint.gguf_loader import read_gguf_header

    _, _, tok = read_gguf_header(GGUF)
    with running_server(_fake(tok)) as srv:
        yield srv, openai.OpenAI(base_url=srv.url("/v1"), api_key="none", max_retries=0)


@pytest.mark.skipif(ENGINE_KIND != "fake", reason="FakeRunner over SmolLM2's tokenizer (one run)")
def test_smollm2_template_tool_calls_and_multi_turn(smollm2):
    srv, client = smollm2
    for tc, one in (("required", None), ({"type": "function", "function": {"name": "get_weather"}},
                                         "get_weather")):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tc,
                                           max_tokens=60, temperature=0, parallel_tool_calls=False)
        assert r.choices[0].finish_reason == "tool_calls"
        _check_calls(r.choices[0].message.tool_calls, one=one)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto",
                                       max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")
    # the template has no tool support: the assistant's call is written as hermes markup
    messages = _conversation()
    tok = httpx.post(srv.url("/tokenize"), json={"model": MODEL, "messages": messages,
                                                 "tools": TOOLS}).json()
    text = httpx.post(srv.url("/detokenize"), json={"model": MODEL,
                                                    "tokens": tok["tokens"]}).json()["prompt"]
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Lima", "days": 2}}\n</tool_call><|im_end|>\n<|im_start|>tool\n'
            'sunny, 24 C<|im_end|>') in text
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=4)
    assert r.usage.prompt_tokens == tok["count"]
    healthy_probe(srv)
    np.testing.assert_equal(len(r.choices), 1)


@pytest.mark.skipif(ENGINE_KIND != "fake", reason="scripted FakeRunner outputs (one run)")
def test_grammar_applies_after_the_reasoning(scripted):
    """A named tool call and a json_schema response under --reasoning_parser=qwen3: the
    thinking span is allowed before the grammar-shaped answer and split off."""
    _, client = scripted
    named = {"type": "function", "function": {"name": "get_weather"}}
    ch = client.chat.completions.create(tools=TOOLS, tool_choice=named, **_ask(5)).choices[0]
    assert ch.message.reasoning == "Plan: Paris." and ch.message.content is None
    assert [(c.function.name, c.function.arguments) for c in ch.message.tool_calls] == [
        ("get_weather", '{"city":"Paris","days":3}')]
    content, reasoning, calls, finish = _stream(client, tools=TOOLS, tool_choice=named, **_ask(5))
    assert (content, reasoning, calls, finish) == (
        "", "Plan: Paris.", [["get_weather", '{"city":"Paris","days":3}']], "tool_calls")
    ch = client.chat.completions.create(response_format={"type": "json_schema", "json_schema": {
        "name": "w", "schema": WEATHER}}, **_ask(5)).choices[0]
    assert ch.message.reasoning == "Plan: Paris." and ch.finish_reason == "stop"
    assert json.loads(ch.message.content) == {"city": "Paris", "days": 3}
