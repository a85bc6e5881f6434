"""Tool-call and reasoning parsers on real model outputs (issue 29), no server.

The outputs are written to each family's documented format (Qwen's function-calling
guide for hermes, Meta's Llama 3.1 JSON tool-calling prompt format, Mistral's
v3 and v11 tokenizer formats, Qwen3 / DeepSeek-R1 thinking spans); the expected
calls and content are read off those strings by hand. Streaming is checked by
feeding every split of each output into two pieces and also one character at a
time (so every token boundary a tag could be split at is covered): the joined
deltas must equal the one-shot parse and no piece of a tag may reach content.
"""

from __future__ import annotations

import json

import pytest

from jaxserve.server.chat_output import ChatOutputSpec, ChoiceParser, merge_deltas
from jaxserve.server.reasoning import pick_reasoning_parser
from jaxserve.server.tool_parsers import ToolStream, pick_tool_parser

QWEN_TWO_CALLS = (
    "<tool_call>\n"
    '{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
    "</tool_call>\n"
    "<tool_call>\n"
    '{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", '
    '"date": "2024-10-01"}}\n'
    "</tool_call>")
SF = {"location": "San Francisco, CA, USA"}
SF_DATE = {"location": "San Francisco, CA, USA", "date": "2024-10-01"}

# (parser, output, expected content, expected [(name, arguments object)])
CASES = [
    ("hermes", QWEN_TWO_CALLS, "\n", [("get_current_temperature", SF),
                                      ("get_temperature_date", SF_DATE)]),
    ("hermes", "Let me check the weather.\n<tool_call>\n{\"name\": \"get_current_temperature\", "
     "\"arguments\": {\"location\": \"San Francisco, CA, USA\"}}\n</tool_call>",
     "Let me check the weather.\n", [("get_current_temperature", SF)]),
    ("hermes", "The answer is 4 < 5, no tools needed.", "The answer is 4 < 5, no tools needed.",
     []),
    # malformed JSON inside the markup stays content, raw; a later good call still parses
    ("hermes", "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": }\n</tool_call>",
     "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": }\n</tool_call>", []),
    ("hermes", "<tool_call>{\"arguments\": {}}</tool_call><tool_call>{\"name\": \"g\", "
     "\"arguments\": {\"k\": [1, 2]}}</tool_call>", "<tool_call>{\"arguments\": {}}</tool_call>",
     [("g", {"k": [1, 2]})]),
    # an unclosed block at the end of the output (max_tokens, or a model that omits it)
    ("hermes", "<tool_call>\n{\"name\": \"g\", \"arguments\": {}}\n", "", [("g", {})]),
    ("hermes", "<tool_call>\n{\"name\": \"g\", \"argu", "<tool_call>\n{\"name\": \"g\", \"argu",
     []),
    ("llama3_json", "{\"name\": \"get_current_conditions\", \"parameters\": {\"location\": "
     "\"San Francisco, CA\", \"unit\": \"Fahrenheit\"}}", "",
     [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})]),
    ("llama3_json", "<|python_tag|>{\"name\": \"a\", \"parameters\": {\"x\": 1}}; "
     "{\"name\": \"b\", \"parameters\": {}}", "", [("a", {"x": 1}), ("b", {})]),
    ("llama3_json", "I think {\"name\": \"a\"} is JSON.", "I think {\"name\": \"a\"} is JSON.", []),
    ("llama3_json", "{\"name\": \"a\", \"parameters\": {\"x\": 1", "{\"name\": \"a\", "
     "\"parameters\": {\"x\": 1", []),
    ("mistral", "[TOOL_CALLS] [{\"name\": \"get_current_weather\", \"arguments\": {\"location\": "
     "\"Paris, France\", \"format\": \"celsius\"}}]", "",
     [("get_current_weather", {"location": "Paris, France", "format": "celsius"})]),
    ("mistral", "[TOOL_CALLS]get_current_weather[ARGS]{\"location\": \"Paris\"}[TOOL_CALLS]"
     "get_time[ARGS]{}", "", [("get_current_weather", {"location": "Paris"}), ("get_time", {})]),
    ("mistral", "Sure.[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {\"a\": [}]", "Sure.[TOOL_CALLS]"
     " [{\"name\": \"f\", \"arguments\": {\"a\": [}]", []),
]
IDS = [f"{c[0]}-{i}" for i, c in enumerate(CASES)]


def _run(parser, pieces):
    s = ToolStream(parser)
    events = [e for p in pieces for e in s.feed(p)] + s.finish()
    content = [e for e in events if isinstance(e, str)]
    calls = [(e.name, json.loads(e.arguments)) for e in events if not isinstance(e, str)]
    return content, calls


@pytest.mark.parametrize("name,text,content,calls", CASES, ids=IDS)
def test_parse_whole_output(name, text, content, calls):
    parser = pick_tool_parser(name, None)
    got_content, got_calls = parser.extract(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert all(c.id for c in got_calls) and len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("name,text,content,calls", CASES, ids=IDS)
def test_stream_at_every_split(name, text, content, calls):
    parser = pick_tool_parser(name, None)
    tags = parser.start_tags + ((parser.end_tag,) if parser.end_tag else ())
    splits = [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        got, got_calls = _run(parser, pieces)
        assert "".join(got) == content and got_calls == calls, pieces
        if calls:  # a well-formed call's tags never reach content, not even in part
            for piece in got:
                for tag in tags:
                    assert not any(piece.endswith(tag[:k]) and k > 1 for k in range(len(tag))), \
                        (pieces, piece)


def test_mistral_ids_are_nine_alphanumerics():
    _, calls = pick_tool_parser("mistral", None).extract("[TOOL_CALLS]f[ARGS]{}")
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()


def test_auto_reads_the_template():
    assert pick_tool_parser("auto", "{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert pick_tool_parser("auto", "<|python_tag|>{{ x }}").name == "llama3_json"
    assert pick_tool_parser("auto", "<tool_call>").name == "hermes"
    assert pick_tool_parser("auto", None).name == "hermes"  # no sign: the fallback
    with pytest.raises(ValueError, match="tool_call_parser='pythonic'"):
        pick_tool_parser("pythonic", None)


THINK = "<think>\nThe user wants 2+2. That is 4.\n</think>\n\nThe answer is 4."
# (parser, output, reasoning, content)
REASONING = [
    ("qwen3", THINK, "\nThe user wants 2+2. That is 4.\n", "\n\nThe answer is 4."),
    ("qwen3", "The answer is 4.", "", "The answer is 4."),  # enable_thinking: false
    ("qwen3", "<think>\nstill thinking", "\nstill thinking", ""),  # cut by max_tokens
    ("qwen3", "<thi", "", "<thi"),
    ("deepseek_r1", "Okay, 2+2 is 4.\n</think>\n\n**4**", "Okay, 2+2 is 4.\n", "\n\n**4**"),
    ("deepseek_r1", THINK, "\nThe user wants 2+2. That is 4.\n", "\n\nThe answer is 4."),
    ("deepseek_r1", "no end tag at all", "no end tag at all", ""),
]


@pytest.mark.parametrize("name,text,reasoning,content", REASONING)
def test_reasoning_split_at_every_split(name, text, reasoning, content):
    parser = pick_reasoning_parser(name)
    assert parser.extract(text) == (reasoning, content)
    # the tags are all that is dropped: reasoning + content joins to the raw text
    assert reasoning + content == text.replace("<think>", "", 1).replace("</think>", "", 1)
    spec = ChatOutputSpec(reasoning=parser)
    for pieces in [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]:
        p = ChoiceParser(spec)
        deltas = [d for piece in pieces for d in p.feed(piece)] + p.finish()
        got_r = "".join(d.get("reasoning", "") for d in deltas)
        got_c = "".join(d.get("content", "") for d in deltas)
        assert (got_r, got_c) == (reasoning, content), pieces
        for d in deltas:
            assert d.get("reasoning") == d.get("reasoning_content")
            if text == "<thi":  # a lone tag prefix at the end is content, as written
                continue
            for piece in (d.get("reasoning", ""), d.get("content", "")):
                assert "<think>" not in piece and "</think>" not in piece
                assert not piece.endswith(("<", "</", "</th", "<th")), (pieces, d)


def test_reasoning_then_tool_call_stream_equals_message():
    text = "<think>I should call the tool.</think>" + QWEN_TWO_CALLS
    spec = ChatOutputSpec(mode="auto", tool_parser=pick_tool_parser("hermes", None),
                          reasoning=pick_reasoning_parser("qwen3"))
    p = ChoiceParser(spec)
    one_shot = merge_deltas(p.feed(text) + p.finish(), with_reasoning=True)
    assert one_shot["reasoning"] == one_shot["reasoning_content"] == "I should call the tool."
    assert one_shot["content"] is None  # only a newline between the calls
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in one_shot["tool_calls"]] == [("get_current_temperature", SF),
                                                   ("get_temperature_date", SF_DATE)]
    assert p.finish_reason("stop") == "tool_calls" and p.finish_reason("length") == "length"
    q = ChoiceParser(spec)
    deltas = [d for ch in text for d in q.feed(ch)] + q.finish()
    heads = [tc for d in deltas for tc in d.get("tool_calls", ()) if "id" in tc]
    assert [(h["index"], h["type"], h["function"]["arguments"]) for h in heads] == [
        (0, "function", ""), (1, "function", "")]
    streamed = merge_deltas(deltas, with_reasoning=True)
    for m in (one_shot, streamed):
        for c in m["tool_calls"]:
            c.pop("id")
    assert streamed == one_shot


def test_named_mode_streams_arguments_as_they_come():
    p = ChoiceParser(ChatOutputSpec(mode="named", named="get_weather"))
    deltas = p.feed('{"city":') + p.feed('"Paris"}') + p.finish()
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert [d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:]] == [
        '{"city":', '"Paris"}']
    msg = merge_deltas(deltas, with_reasoning=False)
    assert msg["content"] is None and msg["tool_calls"][0]["function"]["arguments"] == \
        '{"city":"Paris"}'


def test_required_mode_emits_each_call_as_its_item_closes():
    p = ChoiceParser(ChatOutputSpec(mode="required"))
    first = p.feed('[{"name":"a","parameters":{"x":1}},{"name":"b","para')
    assert [tc["function"] for d in first for tc in d["tool_calls"]] == [
        {"name": "a", "arguments": ""}, {"arguments": '{"x": 1}'}]
    deltas = first + p.feed('meters":{}}]') + p.finish()
    msg = merge_deltas(deltas, with_reasoning=False)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        ("a", '{"x": 1}'), ("b", "{}")]
    assert msg["content"] is None and p.finish_reason("stop") == "tool_calls"
    # cut by max_tokens after one item closed: that call stays, the unfinished one goes
    cut = ChoiceParser(ChatOutputSpec(mode="required"))
    msg = merge_deltas(cut.feed('[{"name":"a","parameters":{}},{"name":"a","param') +
                       cut.finish(), with_reasoning=False)
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["a"]
    assert cut.finish_reason("length") == "length"
    # cut before any item closed: the text is content
    cut = ChoiceParser(ChatOutputSpec(mode="required"))
    assert merge_deltas(cut.feed('[{"name":"a","param') + cut.finish(),
                        with_reasoning=False) == {"role": "assistant",
                                                  "content": '[{"name":"a","param'}


@pytest.mark.parametrize("name,accepted,refused", [
    ("qwen3", ['<think>a </thin b</think>{"a":1}', '{"a":12}'],
     ['<think>x</think><think>{"a":1}', 'x{"a":1}', '{ "a":1}', '<think>x{"a":1}']),
    ("deepseek_r1", ['hmm</think>{"a":1}', '<think>hmm</think>{"a":1}'],
     ['{"a":1}', 'a</think>b</think>{"a":1}']),
])
def test_reasoning_grammar_lets_the_thinking_span_come_first(name, accepted, refused):
    """llguidance, with the ASCII tokenizer: the wrapped grammar takes the span then the
    compact JSON answer (and EOS after it); anything else is refused at some token."""
    import numpy as np

    from jaxserve.server.reasoning import reasoning_grammar
    from jaxserve.structured_output import GrammarCompiler, StructuredOutputsParams
    from test_structured_output import ascii_tokenizer

    tok = ascii_tokenizer()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    so, reads = reasoning_grammar(pick_reasoning_parser(name), StructuredOutputsParams(json=schema))
    assert reads and so.grammar is not None
    compiler = GrammarCompiler(tok, tok.vocab_size, [tok.eos_token_id])

    def allowed(text):
        m = compiler.matcher(so.spec)
        for t in tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]:
            row = np.zeros((tok.vocab_size + 31) // 32, np.int32)
            m.fill_bitmask(row)
            if not np.unpackbits(row.view(np.uint8), bitorder="little")[t]:
                return False
            m.accept(t)
        return True
    try:
        assert [allowed(t) for t in accepted] == [True] * len(accepted)
        assert [allowed(t) for t in refused] == [False] * len(refused)
    finally:
        compiler.close()
    grammar = StructuredOutputsParams(grammar='start: "x"')  # a Lark grammar decides it all
    assert reasoning_grammar(pick_reasoning_parser(name), grammar) == (grammar, False)
