"""Reasoning parsers: split a model's `<think>...</think>` span from its answer (vLLM's).

Chosen by `--reasoning_parser` (vLLM's names):

  qwen3        Qwen3: a reasoning span only when the output opens with `<think>`
               (leading blanks allowed); it runs to `</think>` (or, unfinished, to the
               end). An output that does not open with `<think>` is all content (Qwen3
               with `enable_thinking: false`, or a model that skipped thinking).
  deepseek_r1  DeepSeek-R1 and its distills, whose template writes `<think>` into the
               prompt: the output is reasoning up to `</think>` (a leading `<think>` is
               dropped), then content; no `</think>` at all: everything is reasoning.

The span goes to the message's `reasoning` (vLLM's current name) and
`reasoning_content` (DeepSeek's, SGLang's, llama.cpp's); the tags go nowhere, so
reasoning + content is the raw text less its tags. `ReasoningStream` is the one
path for both modes: a tag split across tokens is held back until it resolves,
so no partial `<think>` / `</think>` ever reaches a delta.
"""

from __future__ import annotations

import json
from typing import Any

from jaxserve.server.tool_parsers import held_back
from jaxserve.structured_output import StructuredOutputsParams

START, END = "<think>", "</think>"


class ReasoningParser:
    """`implicit_start`: the output begins inside the reasoning span without `<think>`."""

    name = ""
    implicit_start = False

    def extract(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a whole output."""
        s = ReasoningStream(self)
        parts = [s.feed(text), s.finish()]
        return "".join(r for r, _ in parts), "".join(c for _, c in parts)


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    implicit_start = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)}


def pick_reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser `--reasoning_parser=name` selects (None / "": no reasoning split).

    Raises:
      ValueError: an unknown name (naming the choices).
    """
    if not name:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser={name!r} is not one of {tuple(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]()


# The thinking span as one Lark lexeme: <think>, any text without </think>, </think>
# (llguidance's `&` / `~` lexeme operators). Its opening tag is optional for
# deepseek_r1, whose template writes <think> into the prompt.
_THINK_BODY = r"THINKBODY: /(.|\n)*/ & ~/(.|\n)*<\/think>(.|\n)*/"
_THINK = {False: r"THINK: /<think>/ THINKBODY /<\/think>/",
          True: r"THINK: /(<think>)?/ THINKBODY /<\/think>/"}
# Compact JSON inside the grammar too (structured_output._JSON_OPTIONS).
_JSON_GUIDANCE = {"whitespace_flexible": False}


def _answer_rule(so: StructuredOutputsParams) -> str | None:
    """The Lark rule text of a spec's answer, or None for a kind not wrapped (grammar)."""
    spec = so.spec
    if spec.kind in ("json", "json_object"):
        schema = json.loads(spec.spec) if spec.kind == "json" else {"type": "object"}
        return "%json " + json.dumps({**schema, "x-guidance": _JSON_GUIDANCE})
    if spec.kind == "regex":
        return "/" + spec.spec.replace("/", "\\/") + "/"
    if spec.kind == "choice":
        return " | ".join(json.dumps(c) for c in json.loads(spec.spec))
    return None


def reasoning_grammar(parser: ReasoningParser | None,
                      so: StructuredOutputsParams | None) -> tuple[Any, bool]:
    """(structured outputs, whether the reasoning parser reads the output) of a request.

    A grammar applies to the answer after the reasoning, as in vLLM: a JSON schema,
    json_object, regex or choice spec is wrapped into a Lark grammar that lets the
    thinking span come first (`qwen3`: an optional `<think>...</think>`;
    `deepseek_r1`: a required `...</think>`, `<think>` optional). A Lark / GBNF
    grammar is kept as is and the reasoning split is off for that request (the
    grammar decides the whole output).
    """
    if parser is None or so is None:
        return so, parser is not None
    rule = _answer_rule(so)
    if rule is None:
        return so, False
    start = "start: THINK body" if parser.implicit_start else "start: THINK? body"
    grammar = "\n".join([start, f"body: {rule}", _THINK[parser.implicit_start], _THINK_BODY])
    return StructuredOutputsParams(grammar=grammar), True


class ReasoningStream:
    """Incremental split of one choice's text; `feed` / `finish` return (reasoning, content)."""

    def __init__(self, parser: ReasoningParser):
        self.p = parser
        self.state = "start"  # start (undecided) | reasoning | content
        self.buf = ""

    def _opening(self) -> tuple[str, str]:
        body = self.buf.lstrip()
        if body.startswith(START):
            self.state, self.buf = "reasoning", body[len(START):]
            return self._reasoning()
        if START.startswith(body):  # blank, or a prefix of <think>: wait
            return "", ""
        if self.p.implicit_start:
            self.state = "reasoning"
            return self._reasoning()
        self.state, text, self.buf = "content", self.buf, ""
        return "", text

    def _reasoning(self) -> tuple[str, str]:
        j = self.buf.find(END)
        if j >= 0:
            reasoning, content = self.buf[:j], self.buf[j + len(END):]
            self.state, self.buf = "content", ""
            return reasoning, content
        keep = held_back(self.buf, (END,))
        out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return out, ""

    def feed(self, text: str) -> tuple[str, str]:
        if self.state == "content":
            return "", text
        self.buf += text
        return self._opening() if self.state == "start" else self._reasoning()

    def finish(self) -> tuple[str, str]:
        """The held text at the end of the output."""
        text, self.buf = self.buf, ""
        if self.state == "reasoning" or (self.state == "start" and self.p.implicit_start
                                         and text.strip()):
            return text, ""
        return "", text
