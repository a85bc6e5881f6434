"""Tool-call parsers: a model's tool-call markup -> OpenAI `tool_calls` (vLLM's parsers).

One parser per model family, chosen by `--tool_call_parser` (vLLM's names):

  hermes       Qwen2.5 / Qwen3 / Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
               any number of blocks anywhere in the text.
  llama3_json  Llama 3.1-3.3 JSON tool calling: the output opens with `<|python_tag|>` or
               `{`, then `{"name": ..., "parameters": {...}}` objects separated by `;`.
  mistral      `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (tokenizer v3-v7) or
               `[TOOL_CALLS]name[ARGS]{...}` repeated (v11+); calls run to the end.
  auto         one of the above picked from the chat template (`pick_tool_parser`),
               hermes when the template gives no sign.

Streaming and non-streaming share one path (`ToolStream`): text outside the markup
flows out as content as soon as no suffix of it could begin a start tag (so a tag
split across tokens never leaks); a block is held until it closes (its end tag, or
the end of the output for formats without one) and then parsed: a well-formed block
becomes tool calls, a malformed one (bad JSON, no name) goes out as content, raw,
so nothing is lost and nothing raises. `extract` is `feed(text)` + `finish()`, so the
joined stream equals the non-streamed message by construction.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any

_ALNUM = string.ascii_letters + string.digits


def hex_tool_call_id() -> str:
    """vLLM's default tool-call id: "chatcmpl-tool-" + 32 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def mistral_tool_call_id() -> str:
    """Mistral's templates require 9 alphanumeric characters (vLLM's MistralToolCall)."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=hex_tool_call_id)

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's `message.tool_calls[i]`."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def _args_json(args: Any) -> str | None:
    """A call's arguments as JSON text: an object as compact-ish JSON (vLLM's
    `json.dumps(..., ensure_ascii=False)`), a string holding a JSON object as is."""
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return json.dumps(args, ensure_ascii=False)


def _call(obj: Any, *arg_keys: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a `{"name": ..., <arg_key>: {...}}` object, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in arg_keys if k in obj), {})
    text = _args_json(args)
    return None if text is None else (obj["name"], text)


class ToolParser:
    """A family's markup: a block opens with one of `start_tags` (or, only as the first
    non-blank text, one of `leading_tags`, kept as part of the block) and closes with
    `end_tag` (None: the block runs to the end of the output).

    Subclasses implement `parse_block`. `skip_special_tokens` is False for families whose
    tags are special tokens (the detokenizer would drop them otherwise).
    """

    name = ""
    start_tags: tuple[str, ...] = ()
    leading_tags: tuple[str, ...] = ()
    end_tag: str | None = None
    skip_special_tokens = True

    def new_id(self) -> str:
        return hex_tool_call_id()

    def parse_block(self, block: str) -> list[tuple[str, str]] | None:
        """[(name, arguments JSON)] of one block's text (between the tags), None if malformed."""
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole output; content is the text outside well-formed markup."""
        s = ToolStream(self)
        events = s.feed(text) + s.finish()
        return ("".join(e for e in events if isinstance(e, str)),
                [e for e in events if isinstance(e, ToolCall)])


class HermesToolParser(ToolParser):
    name = "hermes"
    start_tags = ("<tool_call>",)
    end_tag = "</tool_call>"

    def parse_block(self, block):
        try:
            obj = json.loads(block)
        except ValueError:
            return None
        c = _call(obj, "arguments", "parameters")
        return None if c is None else [c]


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    start_tags = ("<|python_tag|>",)
    leading_tags = ("{",)
    skip_special_tokens = False  # <|python_tag|> is a special token

    def parse_block(self, block):
        dec, calls, i = json.JSONDecoder(), [], 0
        text = block.strip()
        while i < len(text):
            try:
                obj, end = dec.raw_decode(text, i)
            except ValueError:
                return None
            c = _call(obj, "parameters", "arguments")
            if c is None:
                return None
            calls.append(c)
            i = end
            while i < len(text) and text[i] in " \t\r\n;":
                i += 1
        return calls or None


class MistralToolParser(ToolParser):
    name = "mistral"
    start_tags = ("[TOOL_CALLS]",)
    skip_special_tokens = False  # [TOOL_CALLS] / [ARGS] are special tokens

    def new_id(self) -> str:
        return mistral_tool_call_id()

    def parse_block(self, block):
        text = block.strip()
        if text.startswith("["):  # [{"name": ..., "arguments": {...}}, ...]
            try:
                arr = json.loads(text)
            except ValueError:
                return None
            if not isinstance(arr, list) or not arr:
                return None
            calls = [_call(o, "arguments", "parameters") for o in arr]
            return None if any(c is None for c in calls) else calls
        calls = []  # name[ARGS]{...} ([TOOL_CALLS] between calls)
        for part in text.split("[TOOL_CALLS]"):
            name, sep, args = part.strip().partition("[ARGS]")
            text_args = _args_json(args.strip()) if sep else None
            if not name or text_args is None:
                return None
            calls.append((name.strip(), text_args))
        return calls


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}
TOOL_PARSER_CHOICES = ("auto", *TOOL_PARSERS)


def pick_tool_parser(name: str, chat_template: str | None) -> ToolParser:
    """The parser `--tool_call_parser=name` selects; "auto" reads the chat template.

    Raises:
      ValueError: an unknown name (naming the choices).
    """
    if name == "auto":
        t = chat_template or ""
        if "[TOOL_CALLS]" in t:
            name = "mistral"
        elif "<|python_tag|>" in t or "ipython" in t:
            name = "llama3_json"
        else:
            name = "hermes"  # "<tool_call>" templates, and the fallback
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser={name!r} is not one of {TOOL_PARSER_CHOICES}")
    return TOOL_PARSERS[name]()


def held_back(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


class ToolStream:
    """Incremental parse of one choice's text: `feed` each delta, then `finish`.

    Both return events: `str` content pieces and `ToolCall`s, in output order.
    """

    def __init__(self, parser: ToolParser):
        self.p = parser
        self.buf = ""  # text not resolved yet (a possible tag prefix, or an open block)
        self.tag: str | None = None  # the open block's start tag (None: outside)
        self.blank = True  # no non-blank text emitted yet (leading tags still possible)

    def _find_start(self) -> tuple[int, str, bool] | None:
        """(index, tag, keep) of the first block opening in buf, or None."""
        if self.blank and self.p.leading_tags:
            stripped = self.buf.lstrip()
            for tag in self.p.leading_tags:
                if stripped.startswith(tag):
                    return len(self.buf) - len(stripped), tag, True
        found = [(self.buf.find(t), t) for t in self.p.start_tags if t in self.buf]
        if not found:
            return None
        i, t = min(found)
        return i, t, False

    def _holdback(self) -> int:
        if self.blank and self.p.leading_tags and not self.buf.strip():
            return len(self.buf)  # blank so far: a leading tag may still come
        return held_back(self.buf, self.p.start_tags)

    def _content(self, text: str, out: list) -> None:
        if text:
            out.append(text)
            self.blank = self.blank and not text.strip()

    def _close(self, block: str, closed: bool, out: list) -> None:
        calls = self.p.parse_block(block)
        if calls is None:  # malformed: the raw markup is content
            raw = (self.tag if self.tag not in self.p.leading_tags else "") + block
            self._content(raw + ((self.p.end_tag or "") if closed else ""), out)
        else:
            out.extend(ToolCall(n, a, self.p.new_id()) for n, a in calls)
            self.blank = False
        self.tag = None

    def feed(self, text: str) -> list[str | ToolCall]:
        self.buf += text
        out: list[str | ToolCall] = []
        while True:
            if self.tag is None:
                start = self._find_start()
                if start is None:
                    keep = self._holdback()
                    self._content(self.buf[:len(self.buf) - keep], out)
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                i, tag, keep_tag = start
                self._content(self.buf[:i], out)
                self.buf = self.buf[i if keep_tag else i + len(tag):]
                self.tag = tag
            else:
                end = self.p.end_tag
                j = self.buf.find(end) if end else -1
                if j < 0:
                    return out
                block, self.buf = self.buf[:j], self.buf[j + len(end):]
                self._close(block, True, out)

    def finish(self) -> list[str | ToolCall]:
        """The events of the held text at the end of the output (an unclosed block is parsed)."""
        out: list[str | ToolCall] = []
        if self.tag is not None:
            self._close(self.buf, False, out)
        else:
            self._content(self.buf, out)
        self.buf = ""
        return out
