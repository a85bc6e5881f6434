"""POST /v1/chat/completions: messages (+ tools) -> template -> engine -> message or SSE.

The body is checked (`chat_params`, `tool_choice_mode`: 400s naming the field), the
prompt rendered here with the served model's chat template, `tools` and
`chat_template_kwargs` (`chat_tools.render_chat`) and submitted as token ids, so the
engine's plain prompt path serves chat too. `tool_choice` required / named adds the
call's grammar. Each choice's text goes through a `ChoiceParser` (reasoning, tool
calls) in both modes, so streamed deltas join to the non-streamed message.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from jaxserve.server.async_engine import EngineRequest
from jaxserve.server.chat_output import ChatOutputSpec, ChoiceParser, merge_deltas
from jaxserve.server.chat_tools import render_chat, tool_choice_mode, tool_structured_outputs
from jaxserve.server.protocol import ChatCompletionRequest, chat_params, validation_error
from jaxserve.server.reasoning import pick_reasoning_parser, reasoning_grammar
from jaxserve.server.serving import OpenAIServing, _Acc, _GroupStream, _structured_field
from jaxserve.server.token_bytes import ChatLogprobTokens
from jaxserve.server.tool_parsers import ToolParser, pick_tool_parser
from jaxserve.structured_output import body_structured_outputs
from jaxserve.validation import ValidationError


class ChatServing:
    """The chat handler over an `OpenAIServing` (its engine, names, limits, helpers).

    Args:
      serving: the `OpenAIServing`.
      tool_call_parser: vLLM's `--tool-call-parser` name, or "auto" (from the template).
      reasoning_parser: vLLM's `--reasoning-parser` name, or None (no split).
      enable_auto_tool_choice: vLLM's flag; False makes `tool_choice="auto"` a 400.

    Raises:
      ValueError: an unknown parser name (at construction, so `serve` fails fast).
    """

    def __init__(self, serving: OpenAIServing, *, tool_call_parser: str = "auto",
                 reasoning_parser: str | None = None, enable_auto_tool_choice: bool = True):
        self.s = serving
        pick_tool_parser(tool_call_parser, None)  # fail fast on a bad name
        self._tool_parser_name = tool_call_parser
        self._tool_parser: ToolParser | None = None
        self.reasoning = pick_reasoning_parser(reasoning_parser)
        self.auto_enabled = enable_auto_tool_choice

    def tool_parser(self, tok: Any) -> ToolParser:
        """The parser in use ("auto" resolves once, from the served chat template)."""
        if self._tool_parser is None:
            self._tool_parser = pick_tool_parser(self._tool_parser_name,
                                                 getattr(tok, "chat_template", None))
        return self._tool_parser

    def _prepare(self, req: ChatCompletionRequest) -> tuple[Any, list[int], ChatOutputSpec]:
        """(params, prompt ids, output spec) of a body; 400s name the field."""
        s = self.s
        mode, named = tool_choice_mode(req, auto_enabled=self.auto_enabled)
        tok = s.engine.engine.tokenizer
        parser = self.tool_parser(tok)
        auto = mode == "auto" and bool(req.tools)
        try:
            so = tool_structured_outputs(req, mode, named) or body_structured_outputs(req)
            so, reads_reasoning = reasoning_grammar(self.reasoning, so)
        except ValidationError as e:
            raise validation_error(e) from e
        params = chat_params(req, served_model_names=s.model_names,
                             max_logprobs=s.max_logprobs, limits=s.limits, structured_outputs=so,
                             skip_special_tokens=(False if auto and not parser.skip_special_tokens
                                                  else None))
        text = render_chat(tok, req)
        ids = list(tok.encode(text, add_special_tokens=False))
        spec = ChatOutputSpec(mode="auto" if auto else ("none" if mode == "auto" else mode),
                              tool_parser=parser, named=named,
                              reasoning=self.reasoning if reads_reasoning else None)
        return params, ids, spec

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        s = self.s
        s._require_ready()
        params, ids, spec = self._prepare(req)
        await s._compile_grammar(params, "tools" if spec.mode in ("named", "required")
                                 else _structured_field(req))
        base = f"chatcmpl-{uuid.uuid4().hex}"
        group = await s._submit([EngineRequest(base, ids, params, priority=req.priority,
                                               lora_name=s.lora_of(req.model))])
        acc = _Acc(group, req.n)
        head = {"id": base, "object": "chat.completion", "created": int(time.time()),
                "model": req.model or s.model_names[0]}
        top_k = req.top_logprobs or 0
        if req.stream:
            return _GroupStream(s._sse_stream(group, acc, {**head, "object": "chat.completion.chunk"},
                                              req.stream_options,
                                              self._chat_deltas(group, acc, req, top_k, spec)),
                                group)
        if not await s._collect(group, acc, raw):
            return Response(status_code=499)
        choices = []
        for i, ch in enumerate(acc.choices):
            p = ChoiceParser(spec)
            deltas = p.feed("".join(ch.text)) + p.finish()
            choices.append({
                "index": i, "message": merge_deltas(deltas, with_reasoning=self.reasoning is not None),
                "logprobs": (s._logprobs_chat(ch.token_ids, ch.logprobs, top_k)
                             if req.logprobs else None),
                "finish_reason": p.finish_reason(ch.finish_reason),
                "stop_reason": ch.stop_reason})
        return JSONResponse({**head, "choices": choices, "usage": acc.usage()})

    async def _chat_deltas(self, group, acc: _Acc, req: ChatCompletionRequest, top_k: int,
                           spec: ChatOutputSpec) -> AsyncIterator[dict]:
        def choice(idx: int, delta: dict, finish: str | None, logprobs=None):
            return {"index": idx, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

        for i in range(len(acc.choices)):
            yield choice(i, {"role": "assistant", "content": ""}, None)
        readers = [ChatLogprobTokens(self.s.engine.engine.tokenizer) for _ in acc.choices]
        parsers = [ChoiceParser(spec) for _ in acc.choices]
        async for d in group:
            for idx, c in acc.apply(d):
                if not (c.text or c.token_ids or c.finish_reason):
                    continue
                lp = None
                if req.logprobs and c.logprobs is not None:
                    lp = self.s._logprobs_chat(c.token_ids, c.logprobs, top_k, readers[idx])
                p = parsers[idx]
                deltas = p.feed(c.text)
                if c.finish_reason is not None:
                    deltas += p.finish()
                # Logprobs ride on the first delta; a held-back piece yields an empty delta.
                deltas = deltas or [{}]
                for k, delta in enumerate(deltas):
                    last = k == len(deltas) - 1
                    yield choice(idx, delta, p.finish_reason(c.finish_reason) if last else None,
                                 lp if k == 0 else None)
