"""Issue 29's must-hold checks against a running server, with the official `openai` client.

Start the server first (the default SmolLM2), then run this:

    jaxserve serve --port=8011 &
    python scripts/check_tools_openai.py --base_url=http://127.0.0.1:8011/v1

Checks, each printed with its result: `tools` + `tool_choice="required"` and a named
tool return `tool_calls` whose arguments parse as JSON and validate (jsonschema)
against the tool's schema, with finish_reason "tool_calls"; `tool_choice="auto"`
answers 200; streaming yields the same call when the deltas are joined (greedy);
a multi-turn conversation (user -> assistant tool call -> tool result -> answer)
renders and runs; `--samples` seeded samples at temperature 1 for required
(parallel calls on and off) and named all give valid calls (a parallel array that
max_tokens cut keeps its complete calls, finish_reason "length"). Exits 1 on a failure.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import time

import jsonschema
import openai

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string"}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                           "description": "Current weather in a city"}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME,
                                           "description": "Current time in a timezone"}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def valid_calls(choice, *, one: str | None = None, cut_ok: bool = False) -> None:
    """Raises AssertionError unless the choice is only valid tool calls (finish_reason
    "tool_calls", or with `cut_ok` "length": a parallel array cut by max_tokens)."""
    assert choice.finish_reason == "tool_calls" or (
        cut_ok and choice.finish_reason == "length"), choice.finish_reason
    assert choice.message.content is None, choice.message.content
    calls = choice.message.tool_calls
    assert calls, choice.message
    for c in calls:
        assert c.id and c.type == "function"
        assert c.function.name == one if one else c.function.name in SCHEMAS
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def joined_stream(client, **kw) -> list[tuple[str, str]]:
    calls: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            assert not ch.delta.content, ch.delta
            for tc in ch.delta.tool_calls or ():
                if tc.id is not None:
                    calls[tc.index] = [tc.function.name, ""]
                calls[tc.index][1] += tc.function.arguments or ""
    return [tuple(calls[i]) for i in sorted(calls)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base_url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--samples", type=int, default=100)
    ap.add_argument("--max_tokens", type=int, default=96)
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    base = dict(model=model, tools=TOOLS, max_tokens=args.max_tokens)
    failures = 0

    def check(name, fn):
        nonlocal failures
        t0 = time.perf_counter()
        try:
            detail = fn()
            print(f"PASS {name} ({time.perf_counter() - t0:.1f} s) {detail or ''}")
        except Exception as e:  # report every check, then fail
            failures += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}")

    def forced(tc, one):
        r = client.chat.completions.create(messages=ASK, tool_choice=tc, temperature=0, **base)
        valid_calls(r.choices[0], one=one)
        return [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]

    check("required", lambda: forced("required", None))
    check("named", lambda: forced(NAMED, "get_weather"))
    check("auto answers 200", lambda: client.chat.completions.create(
        messages=ASK, tool_choice="auto", **base).choices[0].finish_reason)

    def stream_same(tc):
        kw = dict(messages=ASK, tool_choice=tc, temperature=0, **base)
        whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
        streamed = joined_stream(client, **kw)
        assert streamed == [(c.function.name, c.function.arguments) for c in whole], streamed
        return streamed

    check("stream joins to the same call (required)", lambda: stream_same("required"))
    check("stream joins to the same call (named)", lambda: stream_same(NAMED))

    def multi_turn():
        first = client.chat.completions.create(messages=ASK, tool_choice=NAMED, temperature=0,
                                               **base).choices[0].message
        call = first.tool_calls[0]
        messages = ASK + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function", "function": {
                    "name": call.function.name, "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21, "sky": "clear"}'}]
        r = client.chat.completions.create(messages=messages, temperature=0, **base)
        return repr(r.choices[0].message.content[:80])

    check("multi-turn (call -> result -> answer)", multi_turn)

    def samples(tc, one, parallel):
        n = 4

        def ask(k):
            return client.chat.completions.create(
                messages=ASK, tool_choice=tc, n=n, seed=n * k, temperature=1.0,
                parallel_tool_calls=parallel, **base).choices
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            choices = [c for cs in pool.map(ask, range(args.samples // n)) for c in cs]
        for c in choices:
            valid_calls(c, one=one, cut_ok=parallel and tc == "required")
        cut = sum(c.finish_reason == "length" for c in choices)
        return f"{len(choices)} valid ({cut} cut by max_tokens after their complete calls)"

    check(f"{args.samples} seeded samples, required", lambda: samples("required", None, True))
    check(f"{args.samples} seeded samples, required, one call",
          lambda: samples("required", None, False))
    check(f"{args.samples} seeded samples, named", lambda: samples(NAMED, "get_weather", True))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
