"""One chat choice's text -> OpenAI message / stream deltas (reasoning, content, tool_calls).

`ChoiceParser` is fed the choice's text deltas as the engine makes them and answers
OpenAI `delta` objects; the non-streamed message is the same deltas merged
(`merge_deltas`), so the joined stream equals the message by construction. The
layers, in vLLM's order: the reasoning parser splits off the `<think>` span
(`delta.reasoning` and `delta.reasoning_content`); what follows is the answer, which
the tool parser reads in "auto" mode (tool_calls deltas: the first per call carries
`index`, `id`, `type`, `function.name` and empty `arguments`, the next appends the
arguments). Under a grammar (`tool_choice` named or required) the answer is the
call: named streams its arguments as they come; required is parsed at the end.
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


def _required_calls(text: str) -> list[ToolCall] | None:
    """The calls of a `required` output (`[{"name", "parameters"}, ...]`), None if cut short."""
    try:
        arr = json.loads(text)
    except ValueError:
        return None
    if not isinstance(arr, list) or not all(isinstance(o, dict) and "name" in o for o in arr):
        return None
    return [ToolCall(o["name"], json.dumps(o.get("parameters", {}), ensure_ascii=False))
            for o in arr]


class ChoiceParser:
    """Incremental reader of one choice; `feed(text)` / `finish()` -> list of delta dicts."""

    def __init__(self, spec: ChatOutputSpec):
        self.spec = spec
        self.reasoning = None if spec.reasoning is None else ReasoningStream(spec.reasoning)
        self.tools = (ToolStream(spec.tool_parser)
                      if spec.mode == "auto" and spec.tool_parser is not None else None)
        self.num_calls = 0
        self.raw: list[str] = []  # required mode: the whole output, parsed at the end

    def _answer(self, text: str, out: list, final: bool) -> None:
        if self.spec.mode == "named":
            if self.num_calls == 0:
                out.extend(_call_deltas(0, ToolCall(self.spec.named, "", hex_tool_call_id()))[:1])
                self.num_calls = 1
            if text:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return
        if self.spec.mode == "required":
            self.raw.append(text)
            if final:
                calls = _required_calls("".join(self.raw))
                if calls is None:  # cut short (finish_reason "length"): the text as content
                    if "".join(self.raw):
                        out.append({"content": "".join(self.raw)})
                    return
                for c in calls:
                    out.extend(_call_deltas(self.num_calls, c))
                    self.num_calls += 1
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
        """OpenAI's "tool_calls" when the choice stopped after emitting calls."""
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
