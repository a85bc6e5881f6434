"""One chat choice's text -> OpenAI message / stream deltas (reasoning, content, tool_calls).

`ChoiceParser` is fed the choice's text deltas as the engine makes them and answers
OpenAI `delta` objects; the non-streamed message is the same deltas merged
(`merge_deltas`), so the joined stream equals the message by construction. The
layers, in vLLM's order: the reasoning parser splits off the `<think>` span
(`delta.reasoning` and `delta.reasoning_content`); what follows is the answer, which
the tool parser reads in "auto" mode (tool_calls deltas: the first per call carries
`index`, `id`, `type`, `function.name` and empty `arguments`, the next appends the
arguments). Under a grammar (`tool_choice` named or required) the answer is the
call: named streams its arguments as they come; required emits each item of its
`[{"name", "parameters"}, ...]` array as the item closes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from jaxserve.server.reasoning import ReasoningParser, ReasoningStream
from jaxserve.server.tool_parsers import ToolCall, ToolParser, ToolStream, hex_tool_call_id


@dataclass(frozen=True)
class ChatOutputSpec:
    """How a request's choices are read.

    Args:
      mode: "none" (plain content), "auto" (tool parser on the answer), "named" or
        "required" (the output is the grammar-shaped call).
      tool_parser: the server's parser (used in "auto").
      reasoning: the server's reasoning parser, or None (also when the request's own Lark
        grammar decides the whole output: `reasoning.reasoning_grammar`).
      named: the function of "named" mode.
    """

    mode: str = "none"
    tool_parser: ToolParser | None = None
    reasoning: ReasoningParser | None = None
    named: str | None = None


def _call_deltas(index: int, call: ToolCall) -> list[dict[str, Any]]:
    head = {"index": index, "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": ""}}
    return [{"tool_calls": [head]},
            {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}]


_DECODER = json.JSONDecoder()


def _next_item(text: str, at: int) -> tuple[ToolCall, int] | None:
    """The call at `text[at:]` of a `required` array (`{"name", "parameters"}`) and the
    index past it and its separator, or None while the item is unfinished."""
    try:
        obj, end = _DECODER.raw_decode(text, at)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    call = ToolCall(obj["name"], json.dumps(obj.get("parameters", {}), ensure_ascii=False))
    return call, end + (text[end:end + 1] == ",")


class ChoiceParser:
    """Incremental reader of one choice; `feed(text)` / `finish()` -> list of delta dicts."""

    def __init__(self, spec: ChatOutputSpec):
        self.spec = spec
        self.reasoning = None if spec.reasoning is None else ReasoningStream(spec.reasoning)
        self.tools = (ToolStream(spec.tool_parser)
                      if spec.mode == "auto" and spec.tool_parser is not None else None)
        self.num_calls = 0
        self.raw = ""  # required mode: the output so far (the JSON array)
        self.at = 1  # required mode: where the next unparsed item starts (past "[")

    def _answer(self, text: str, out: list, final: bool) -> None:
        if self.spec.mode == "named":
            if self.num_calls == 0:
                out.extend(_call_deltas(0, ToolCall(self.spec.named, "", hex_tool_call_id()))[:1])
                self.num_calls = 1
            if text:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return
        if self.spec.mode == "required":  # each array item is a call once it closes
            self.raw += text
            while (item := _next_item(self.raw, self.at)) is not None:
                out.extend(_call_deltas(self.num_calls, item[0]))
                self.num_calls, self.at = self.num_calls + 1, item[1]
            if final and self.num_calls == 0 and self.raw:  # cut before one call closed
                out.append({"content": self.raw})
            return
        events = [text] if self.tools is None else self.tools.feed(text)
        if final and self.tools is not None:
            events += self.tools.finish()
        for e in events:
            if isinstance(e, ToolCall):
                out.extend(_call_deltas(self.num_calls, e))
                self.num_calls += 1
            elif e:
                out.append({"content": e})

    def _step(self, text: str, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.reasoning is not None:
            reasoning, text = (self.reasoning.finish() if final else self.reasoning.feed(text))
            if reasoning:
                out.append({"reasoning": reasoning, "reasoning_content": reasoning})
        self._answer(text, out, final)
        return out

    def feed(self, text: str) -> list[dict[str, Any]]:
        return self._step(text, False) if text else []

    def finish(self) -> list[dict[str, Any]]:
        """The deltas of held text at the end of the choice (call once)."""
        return self._step("", True)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI's "tool_calls" when the choice stopped after emitting calls ("length"
        stays: a `required` array cut by max_tokens keeps the calls that closed before
        the cut and drops the unfinished one)."""
        return "tool_calls" if engine_reason == "stop" and self.num_calls else engine_reason


def merge_deltas(deltas: list[dict[str, Any]], *, with_reasoning: bool) -> dict[str, Any]:
    """The non-streamed `message` of a choice's deltas: content (null when the choice is
    only tool calls), reasoning fields when a reasoning parser is on, tool_calls when any."""
    content, reasoning, calls = [], [], []
    for d in deltas:
        content.append(d.get("content", ""))
        reasoning.append(d.get("reasoning", ""))
        for tc in d.get("tool_calls", ()):
            if "id" in tc:
                calls.append({"id": tc["id"], "type": "function",
                              "function": dict(tc["function"])})
            else:
                calls[tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
    text = "".join(content)
    msg: dict[str, Any] = {"role": "assistant",
                           "content": None if calls and not text.strip() else text}
    if with_reasoning:
        r = "".join(reasoning) or None
        msg["reasoning"] = msg["reasoning_content"] = r
    if calls:
        msg["tool_calls"] = calls
    return msg
