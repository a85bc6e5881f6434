"""Bad inputs get OpenAI-style 4xx errors naming the field; the server stays healthy after each."""

from __future__ import annotations

import httpx
import pytest

from .helpers import MODEL, healthy_probe

M = 64  # max_model_len of the default test engine
CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"


def _c(**kw):
    return {"model": MODEL, "prompt": "hello", "max_tokens": 4, **kw}


def _m(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}


def _TOOL(name, parameters=None):
    fn = {"name": name} if parameters is None else {"name": name, "parameters": parameters}
    return {"type": "function", "function": fn}


BAD = [
    # (id, route, body, param the error must name)
    ("prompt_too_long", CMPL, _c(prompt=[5] * M), "prompt"),
    ("prompt_far_too_long", CMPL, _c(prompt="x" * 5000), "prompt"),
    ("n_zero", CMPL, _c(n=0), "n"),
    ("n_17", CMPL, _c(n=17), "n"),
    ("n_huge", CMPL, _c(n=10**12), "n"),
    ("n_string", CMPL, _c(n="2"), "n"),
    ("n_float", CMPL, _c(n=2.5), "n"),
    ("top_p_zero", CMPL, _c(top_p=0), "top_p"),
    ("top_p_big", CMPL, _c(top_p=1.5), "top_p"),
    ("temperature_negative", CMPL, _c(temperature=-0.5), "temperature"),
    ("temperature_string", CMPL, _c(temperature="hot"), "temperature"),
    ("unknown_model", CMPL, _c(model="gpt-17"), "model"),
    ("empty_prompt", CMPL, _c(prompt=""), "prompt"),
    ("empty_prompt_list", CMPL, _c(prompt=[]), "prompt"),
    ("empty_string_in_list", CMPL, _c(prompt=[""]), "prompt"),
    ("empty_token_list_in_list", CMPL, _c(prompt=[[]]), "prompt"),
    ("missing_prompt", CMPL, {"model": MODEL}, "prompt"),
    ("prompt_wrong_type", CMPL, _c(prompt={"text": "hi"}), "prompt"),
    ("token_bool", CMPL, _c(prompt=[True, 5]), "prompt"),
    ("token_negative", CMPL, _c(prompt=[-1, 5]), "prompt"),
    ("token_out_of_vocab", CMPL, _c(prompt=[5, 10**6]), "prompt"),
    ("max_tokens_zero", CMPL, _c(max_tokens=0), "max_tokens"),
    ("max_tokens_negative", CMPL, _c(max_tokens=-1), "max_tokens"),
    ("max_tokens_fraction", CMPL, _c(max_tokens=0.5), "max_tokens"),
    ("max_tokens_string", CMPL, _c(max_tokens="5"), "max_tokens"),
    ("logprobs_negative", CMPL, _c(logprobs=-1), "logprobs"),
    ("logprobs_too_many", CMPL, _c(logprobs=10**6), "logprobs"),
    ("echo_with_too_many_logprobs", CMPL, _c(echo=True, logprobs=10**6), "logprobs"),
    ("prompt_logprobs_negative", CMPL, _c(prompt_logprobs=-1), "prompt_logprobs"),
    ("prompt_logprobs_too_many", CMPL, _c(prompt_logprobs=10**6), "prompt_logprobs"),
    ("stop_empty_string", CMPL, _c(stop=[""]), "stop"),
    ("stop_wrong_type", CMPL, _c(stop=5), "stop"),
    ("stream_string", CMPL, _c(stream="yes"), "stream"),
    ("stream_options_bad", CMPL, _c(stream=True, stream_options={"include_usage": "y"}),
     "stream_options"),
    ("seed_negative", CMPL, _c(seed=-1), "seed"),
    ("best_of", CMPL, _c(best_of=3), "best_of"),
    ("suffix", CMPL, _c(suffix="tail"), "suffix"),
    ("top_k", CMPL, _c(top_k=-2), "top_k"),
    ("min_p", CMPL, _c(min_p=2), "min_p"),
    ("repetition_penalty", CMPL, _c(repetition_penalty=0), "repetition_penalty"),
    ("min_tokens_over_max", CMPL, _c(min_tokens=10, max_tokens=2), "min_tokens"),
    ("too_many_stop_token_ids", CMPL, _c(stop_token_ids=list(range(17))), "stop_token_ids"),
    ("priority_string", CMPL, _c(priority="high"), "priority"),
    ("too_many_choices", CMPL, _c(prompt=["a"] * 40, n=8), "prompt"),
    ("logit_bias", CMPL, _c(logit_bias={"5": 101.0}), "logit_bias"),
    ("chat_prompt_logprobs", CHAT, _m(prompt_logprobs=1), "prompt_logprobs"),  # not dropped
    ("chat_empty_messages", CHAT, _m(messages=[]), "messages"),
    ("chat_missing_messages", CHAT, {"model": MODEL}, "messages"),
    ("chat_bad_role", CHAT, _m(messages=[{"role": "wizard", "content": "x"}]), "messages"),
    ("chat_content_int", CHAT, _m(messages=[{"role": "user", "content": 5}]), "messages"),
    ("chat_max_completion_tokens_zero", CHAT, _m(max_completion_tokens=0),
     "max_completion_tokens"),
    ("chat_max_tokens_zero", CHAT, _m(max_tokens=0), "max_tokens"),
    ("chat_top_logprobs_without_logprobs", CHAT, _m(top_logprobs=2), "top_logprobs"),
    ("chat_top_logprobs_too_many", CHAT, _m(logprobs=True, top_logprobs=10**4), "top_logprobs"),
    # Tool calling (issue 29): bad tool definitions and tool_choice values name their field.
    ("chat_tool_not_function", CHAT, _m(tools=[{"type": "code_interpreter",
                                                "function": {"name": "f"}}]), "tools"),
    ("chat_tool_no_name", CHAT, _m(tools=[{"type": "function", "function": {}}]), "tools"),
    ("chat_tool_empty_name", CHAT, _m(tools=[_TOOL("")]), "tools"),
    ("chat_tool_twice", CHAT, _m(tools=[_TOOL("f"), _TOOL("f")]), "tools"),
    ("chat_tool_bad_schema", CHAT, _m(tools=[_TOOL("f", {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "(["}}})]), "tools"),
    ("chat_tool_dangling_ref", CHAT, _m(tools=[_TOOL("f", {"$ref": "#/$defs/nope"})]), "tools"),
    ("chat_tool_schema_not_object", CHAT, _m(tools=[_TOOL("f", ["x"])]), "tools"),
    ("chat_tool_choice_unknown", CHAT, _m(tools=[_TOOL("f")], tool_choice="always"),
     "tool_choice"),
    ("chat_tool_choice_not_in_tools", CHAT, _m(tools=[_TOOL("f")], tool_choice={
        "type": "function", "function": {"name": "g"}}), "tool_choice"),
    ("chat_tool_choice_no_name", CHAT, _m(tools=[_TOOL("f")], tool_choice={"type": "function"}),
     "tool_choice"),
    ("chat_required_without_tools", CHAT, _m(tool_choice="required"), "tool_choice"),
    ("chat_required_and_response_format", CHAT, _m(tools=[_TOOL("f")], tool_choice="required",
                                                   response_format={"type": "json_object"}),
     "tool_choice"),
    ("chat_tool_call_args_not_json", CHAT, _m(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "a", "type": "function", "function": {
            "name": "f", "arguments": "{oops"}}]}]), "messages"),
    ("chat_template_kwargs_reserved", CHAT, _m(chat_template_kwargs={"messages": []}),
     "chat_template_kwargs"),
    ("chat_response_format_xml", CHAT, _m(response_format={"type": "xml"}), "response_format"),
    ("chat_n_17", CHAT, _m(n=17), "n"),
    ("chat_unknown_model", CHAT, _m(model="nope"), "model"),
    ("chat_too_long", CHAT, _m(messages=[{"role": "user", "content": "y" * 200}]), "prompt"),
]


@pytest.mark.parametrize("route,body,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_bad_input_is_400_naming_the_field(server, route, body, param, stream):
    if stream and "stream" not in body:
        body = {**body, "stream": True}
    r = httpx.post(server.url(route), json=body, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error" and err["message"]
    healthy_probe(server)


@pytest.mark.parametrize("content", [b"{not json", b"", b"[1, 2]", b"null", b'"text"'])
def test_malformed_body_is_400(server, content):
    r = httpx.post(server.url(CMPL), content=content,
                   headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    healthy_probe(server)


def test_unknown_route_is_404_and_wrong_method_405(server):
    r = httpx.get(server.url("/v1/nope"))
    assert r.status_code == 404 and "/v1/nope" in r.json()["error"]["message"]
    r = httpx.get(server.url(CMPL))
    assert r.status_code == 405 and r.json()["error"]["message"]
    healthy_probe(server)


def test_error_message_names_the_limit(server):
    r = httpx.post(server.url(CMPL), json=_c(n=17))
    assert "16" in r.json()["error"]["message"]
    r = httpx.post(server.url(CMPL), json=_c(prompt=[5] * M))
    assert str(M) in r.json()["error"]["message"]
    r = httpx.post(server.url(CMPL), json=_c(model="gpt-17"))
    assert r.json()["error"]["code"] == "model_not_found"
