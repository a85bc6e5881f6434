"""Structured output over HTTP: response_format (json_object, json_schema) on both
endpoints, vLLM's guided_* extras and structured_outputs, through the official `openai`
client; every bad field is a 400 naming it, and the server keeps serving.

Runs on either engine kind (helpers.ENGINE_KIND): the FakeRunner obeys the grammar
bitmask (the scripted token if allowed, else the next allowed id), the tiny real
model samples under it. Both use the printable-ASCII tokenizer of
tests/test_structured_output.py (JSON needs its punctuation). Outputs are checked
with `jsonschema`, `re.fullmatch` and membership in the choices.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from jaxserve.config import ModelConfig
from jaxserve.engine import LLMEngine, make_engine_config
from jaxserve.worker.fake_runner import FakeRunner, counting_token
from test_structured_output import MODEL_VOCAB, SCHEMAS, ascii_tokenizer, so_engine

from .helpers import ENGINE_KIND, MODEL, healthy_probe, running_server

SCHEMA = SCHEMAS[0]
MSG = [{"role": "user", "content": "Give me JSON"}]


def _engine():
    if ENGINE_KIND != "fake":
        return so_engine()
    model = ModelConfig.tiny(vocab_size=MODEL_VOCAB, max_position_embeddings=512)
    config = make_engine_config(model, max_model_len=192, block_size=4, num_kv_blocks=400,
                                max_num_seqs=8, max_num_batched_tokens=64)
    runner = FakeRunner.for_config(config, token_fn=counting_token(MODEL_VOCAB,
                                                                   config.max_logprobs),
                                   step_delay=0.001)
    return LLMEngine(config, tokenizer=ascii_tokenizer(), runner=runner, model_name=MODEL)


@pytest.fixture(scope="module")
def srv():
    with running_server(_engine()) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url("/v1"), api_key="none", max_retries=0)


def test_openai_chat_json_schema(client):
    for seed in range(4):
        r = client.chat.completions.create(
            model=MODEL, messages=MSG, max_tokens=96, seed=seed, temperature=1.0,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}})
        ch = r.choices[0]
        assert ch.finish_reason == "stop", ch
        jsonschema.validate(json.loads(ch.message.content), SCHEMA)


def test_openai_completions_response_format_and_guided_fields(client):
    r = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=96, seed=1,
                                  extra_body={"response_format": {
                                      "type": "json_schema",
                                      "json_schema": {"name": "x", "schema": SCHEMAS[1]}}})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS[1])
    r = client.completions.create(model=MODEL, prompt="obj:", max_tokens=150, seed=2,
                                  extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    else:
        assert r.choices[0].text.startswith("{")
    r = client.completions.create(model=MODEL, prompt="code:", max_tokens=20, seed=3, n=3,
                                  extra_body={"guided_regex": r"[a-c]{2}-[0-9]{1,2}"})
    assert all(re.fullmatch(r"[a-c]{2}-[0-9]{1,2}", c.text) for c in r.choices), r.choices
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=20, seed=4,
                                       extra_body={"guided_choice": ["sunny", "rainy"]})
    assert r.choices[0].message.content in ("sunny", "rainy")
    r = client.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=20, seed=5,
        extra_body={"structured_outputs": {"grammar": 'root ::= "n=" [0-9] ";"'}})
    assert re.fullmatch(r"n=[0-9];", r.choices[0].message.content), r.choices[0].message.content
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=96, seed=6,
                                       extra_body={"guided_json": json.dumps(SCHEMA)})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_stream_guided_choice(client):
    stream = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=20, seed=7,
                                            stream=True,
                                            extra_body={"guided_choice": ["alpha", "beta gamma"]})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text in ("alpha", "beta gamma"), text


BAD = [
    ({"response_format": {"type": "xml"}}, "response_format", "must be 'text'"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "bogus"}}}}, "response_format", "Invalid type"),
    ({"guided_json": {"type": "object", "properties": 3}}, "guided_json", "invalid json"),
    ({"guided_json": "{oops"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "(a"}, "guided_regex", "unclosed group"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_grammar": "start: nothing_here"}, "guided_grammar", "unknown name"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs", "unknown key"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "conflicts with"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "conflicts with"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "conflicts with response_format"),
    # valid grammar, but no token of this vocabulary can write it: known before the 200
    ({"guided_choice": ["\u00e9t\u00e9"]}, "guided_choice", "dead end"),
]


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("extra, param, words", BAD)
def test_bad_structured_fields_are_400_naming_the_field(srv, endpoint, extra, param, words):
    body = ({"model": MODEL, "prompt": "x"} if endpoint == "/v1/completions"
            else {"model": MODEL, "messages": MSG})
    r = httpx.post(srv.url(endpoint), json={**body, "max_tokens": 5, **extra}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert words in err["message"], err
    healthy_probe(srv)


@pytest.mark.skipif(ENGINE_KIND == "fake", reason="the FakeRunner does not apply min_tokens")
def test_dead_end_at_run_time_is_a_400_and_the_server_keeps_serving(srv):
    # After 'a' the grammar allows only 'b' and 'c', which min_tokens suppresses as stop ids.
    b, c = ascii_tokenizer().encode("bc")
    r = httpx.post(srv.url("/v1/completions"), json={
        "model": MODEL, "prompt": "x", "max_tokens": 10, "temperature": 0, "min_tokens": 5,
        "stop_token_ids": [b, c], "guided_regex": "a[bc]"}, timeout=30)
    assert r.status_code == 400, r.text
    assert "dead end" in r.json()["error"]["message"]
    healthy_probe(srv)


def test_wrong_types_and_best_of_keep_their_400(srv):
    for extra, param in (({"guided_choice": "yes"}, "guided_choice"),
                         ({"guided_regex": 5}, "guided_regex"),
                         ({"best_of": 3, "n": 1}, "best_of")):
        r = httpx.post(srv.url("/v1/completions"),
                       json={"model": MODEL, "prompt": "x", "max_tokens": 3, **extra}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    healthy_probe(srv)
