"""The two generation endpoints: request -> engine requests -> JSON or SSE.

Both endpoints share one path: validate the body into `SamplingParams`
(400 naming the field), add every prompt as one engine request through
`AsyncEngine.submit` (the engine's synchronous `ValueError` -> 400), then
either collect the deltas into one JSON body (polling
`request.is_disconnected()` so a vanished client's request is aborted) or
stream them as OpenAI chunks over SSE (a disconnect cancels the generator,
whose `finally` aborts the request). Text, token counts and usage are built
from the same deltas in both modes, so streamed text concatenates to the
non-streamed text and the usage objects are equal.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxserve.server.async_engine import (AddRequestError, AsyncEngine, CompletionDelta,
                                          EngineRequest, QueueFullError, RequestDelta,
                                          RequestGroup)
from jaxserve.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                      check_num_choices, completion_params,
                                      echo_without_generation, normalize_prompts,
                                      validation_error)
from jaxserve.server.token_bytes import ChatLogprobTokens
from jaxserve.structured_output import is_grammar_error, structured_sources
from jaxserve.validation import Limits, ValidationError, validate_prompt

# How often a non-streaming handler asks whether its client is still there (s).
DISCONNECT_POLL_S = 0.1

# Seconds a client is told to wait (Retry-After) when the waiting queue is full.
RETRY_AFTER_S = 1
# A validator message starts with its field: "stop_token_ids[2]=...".
_FIELD_RE = re.compile(r"^([a-z_]+)(?:\[\d+\])*=")

_ENGINE_PARAMS = ("prompt", "messages", "max_tokens", "n", "stop_token_ids", "logprobs",
                  "priority", "seed", "top_k", "min_tokens")


_SAMPLING_FIELDS = frozenset(CompletionRequest.model_fields) | frozenset(
    ChatCompletionRequest.model_fields)


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class _Acc:
    """Per-choice accumulation of deltas; choice index = prompt_index * n + sample index."""

    def __init__(self, group: RequestGroup, n: int):
        self.n = n
        self.prompt_index = {rid: i for i, rid in enumerate(group.request_ids)}
        self.choices = [_Choice() for _ in range(len(group.request_ids) * n)]
        self.prompt_tokens = sum(len(p) for p in group.prompt_token_ids)
        self.prompt_ids = list(group.prompt_token_ids)
        # Per prompt: vLLM's prompt_logprobs list once its prefill is done (when asked for).
        self.prompt_logprobs: list[list | None] = [None] * len(group.request_ids)

    def apply(self, d: RequestDelta) -> list[tuple[int, CompletionDelta]]:
        if d.error is not None:
            raise APIError(d.status, d.error, err_type=None if d.status != 500 else "server_error")
        if d.prompt_logprobs is not None:
            self.prompt_logprobs[self.prompt_index[d.request_id]] = d.prompt_logprobs
        out = []
        for c in d.outputs:
            if c.finish_reason == "error":
                if is_grammar_error(c.error):  # the request's grammar reached a dead end
                    raise APIError(400, f"request failed: {c.error}")
                raise APIError(500, f"request failed inside the engine: {c.error}",
                               err_type="server_error")
            idx = self.prompt_index[d.request_id] * self.n + c.index
            ch = self.choices[idx]
            if ch.finish_reason is not None and not (c.text or c.token_ids):
                continue  # a finished sample while its siblings run (n > 1): said once
            ch.text.append(c.text)
            ch.token_ids.extend(c.token_ids)
            if c.logprobs is not None:
                ch.logprobs.extend(c.logprobs)
            if c.finish_reason is not None:
                ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason
            out.append((idx, c))
        return out

    def usage(self) -> dict[str, int]:
        completion = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}


def _structured_field(req: Any) -> str:
    """The body field that asked for structured output (for a compile error's `param`)."""
    src = structured_sources(req)
    return src[0][0].split(".", 1)[0] if src else "structured_outputs"


def _guess_param(msg: str) -> str | None:
    m = _FIELD_RE.match(msg)
    if m and m.group(1) in _SAMPLING_FIELDS:
        return m.group(1)
    low = msg.lower()
    for p in _ENGINE_PARAMS:
        if p in low:
            return p
    if "max_model_len" in low or "token" in low:
        return "prompt"
    return None


class _GroupStream(StreamingResponse):
    """SSE response that aborts its engine requests however the response ends.

    The generator's own `finally` covers disconnects mid-stream; this covers a
    client that leaves before the generator's first step (a never-started async
    generator runs no `finally`).
    """

    def __init__(self, content, group: RequestGroup):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.group = group

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.group.abort()


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class OpenAIServing:
    """Handlers for /v1/completions (and the helpers /v1/chat/completions shares,
    `jaxserve.server.serving_chat`).

    Args:
      engine: the running `AsyncEngine`.
      served_model_names: names accepted in the `model` field (first is reported).
    """

    def __init__(self, engine: AsyncEngine, served_model_names: list[str]):
        self.engine = engine
        self._names = served_model_names
        self._token_str: dict[int, str] = {}

    @property
    def model_names(self) -> list[str]:
        """Accepted `model` names: the served names (empty config -> the engine's
        `model_name`), then the registered LoRA adapters' names (issue 27)."""
        base = self._names or [getattr(self.engine.engine, "model_name", None) or "jaxserve"]
        return base + [n for n in self.lora_names if n not in base]

    @property
    def lora_names(self) -> list[str]:
        """Names of the engine's registered LoRA adapters (none without LoRA)."""
        lora = getattr(self.engine.engine, "lora", None)
        return [r.lora_name for r in lora.list_loras()] if lora is not None else []

    def lora_of(self, model: str | None) -> str | None:
        """The adapter a request's `model` names, or None for the base model."""
        return model if model is not None and model in self.lora_names else None

    def _require_ready(self) -> None:
        if not self.engine.is_ready:
            raise APIError(503, f"the engine is {self.engine.state}; retry later")

    @property
    def limits(self) -> Limits | None:
        """The served model's limits for the validator (None before the engine exists)."""
        cfg = getattr(self.engine.engine, "config", None)
        return None if cfg is None else Limits.from_config(cfg)

    @property
    def max_logprobs(self) -> int:
        """The largest `logprobs` / `top_logprobs` accepted (EngineConfig.max_logprobs)."""
        return getattr(getattr(self.engine.engine, "config", None), "max_logprobs", 20)

    # ------------------------------------------------------------------ helpers
    def token_str(self, token_id: int) -> str:
        s = self._token_str.get(token_id)
        if s is None:
            s = self.engine.engine.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_str) < 1 << 17:
                self._token_str[token_id] = s
        return s

    async def _compile_grammar(self, params: Any, field: str) -> None:
        """Compile a structured-output spec before the 200 (the engine's cached compiler,
        off the event loop): an error only the tokenizer reveals is a 400 naming `field`."""
        so = params.structured_outputs
        grammars = getattr(self.engine.engine, "grammars", None)
        if so is None or grammars is None:
            return
        try:
            await asyncio.wrap_future(grammars.submit(so.spec))
        except Exception as e:  # ValidationError, GrammarDeadEnd
            raise APIError(400, f"{field}: {e}", param=field) from e

    async def _submit(self, reqs: list[EngineRequest]) -> RequestGroup:
        self._require_ready()
        try:
            return await self.engine.submit(reqs)
        except AddRequestError as e:
            where = f" (prompt[{e.index}])" if len(reqs) > 1 else ""
            raise APIError(400, f"{e}{where}", param=_guess_param(str(e))) from e
        except QueueFullError as e:
            raise APIError(503, f"{e}; retry later",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from e
        except RuntimeError as e:
            raise APIError(503, f"{e}; retry later") from e

    @staticmethod
    async def _collect(group: RequestGroup, acc: _Acc, raw: Request) -> bool:
        """Drain the group into `acc`; False if the client disconnected (request aborted)."""
        loop = asyncio.get_running_loop()
        poll_at = loop.time() + DISCONNECT_POLL_S
        try:
            while not group.finished:
                try:
                    d = await asyncio.wait_for(group.next(), max(0.0, poll_at - loop.time()))
                    acc.apply(d)
                except TimeoutError:
                    pass
                if loop.time() >= poll_at:
                    if await raw.is_disconnected():
                        return False
                    poll_at = loop.time() + DISCONNECT_POLL_S
            return True
        finally:
            group.abort()

    def _logprobs_completion(self, ch: _Choice, offset0: int) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = offset0
        for tid, lp in zip(ch.token_ids, ch.logprobs):
            s = self.token_str(tid)
            tokens.append(s)
            token_lps.append(lp.get(tid))
            tops.append({self.token_str(t): v
                         for t, v in sorted(lp.items(), key=lambda kv: -kv[1])})
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    def _echo_logprobs(self, ids: list[int], entries: list, k: int) -> dict[str, Any]:
        """OpenAI's completions logprobs of echoed prompt tokens (the first has None)."""
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = 0
        for tid, e in zip(ids, entries):
            s = self.token_str(tid)
            tokens.append(s)
            token_lps.append(None if e is None else e.get(tid))
            if e is None:
                tops.append(None)
            else:
                alts = sorted(((t, v) for t, v in e.items() if t != tid), key=lambda kv: -kv[1])
                tops.append({self.token_str(t): v for t, v in [(tid, e[tid])] + alts[:k]})
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    def _echo_only(self, acc: _Acc, req: CompletionRequest, head: dict,
                   echo: list[str]) -> dict[str, Any]:
        """The body of an echo-without-generation request: each choice is its prompt's
        text (and prompt logprobs, first null), finish_reason "length", no completion
        tokens; the one token the engine ran for it is dropped."""
        choices = []
        for i in range(len(acc.choices)):
            p = i // req.n
            lp = None
            if req.logprobs is not None:
                ids = acc.prompt_ids[p]
                lp = self._echo_logprobs(ids, acc.prompt_logprobs[p] or [None] * len(ids),
                                         req.logprobs)
            choices.append({"index": i, "text": echo[p], "logprobs": lp,
                            "finish_reason": "length", "stop_reason": None})
        for ch in acc.choices:  # so acc.usage() (JSON and the stream's last chunk) counts 0
            ch.token_ids, ch.logprobs, ch.text = [], [], []
        return {**head, "choices": choices, "usage": acc.usage()}

    def _with_echo_logprobs(self, acc: _Acc, p: int, k: int, completion: dict) -> dict:
        """The prompt's echo logprobs prepended to a choice's completion logprobs."""
        ids = acc.prompt_ids[p]
        head = self._echo_logprobs(ids, acc.prompt_logprobs[p] or [None] * len(ids), k)
        return {key: head[key] + completion[key] for key in head}

    def _vllm_prompt_logprobs(self, acc: _Acc, p: int) -> list | None:
        """vLLM's choice field: [None, {"<id>": {"logprob", "decoded_token"}}, ...]."""
        entries = acc.prompt_logprobs[p]
        if entries is None:
            return None
        return [None if e is None else
                {str(t): {"logprob": v, "decoded_token": self.token_str(t)} for t, v in e.items()}
                for e in entries]

    def _logprobs_chat(self, token_ids, logprobs, top_k: int,
                       reader: ChatLogprobTokens | None = None) -> dict[str, Any]:
        """Chat `logprobs.content`; each token's real bytes (`reader` carries a streamed
        choice's unfinished character from one chunk to the next)."""
        reader = reader or ChatLogprobTokens(self.engine.engine.tokenizer)
        content = []
        for tid, lp in zip(token_ids, logprobs):
            top = sorted(lp.items(), key=lambda kv: -kv[1])[:top_k]
            entries = [reader.entry(t) for t in (tid, *(t for t, _ in top))]
            reader.advance(tid)
            content.append({
                "token": entries[0][0], "logprob": lp.get(tid), "bytes": entries[0][1],
                "top_logprobs": [{"token": s, "logprob": v, "bytes": b}
                                 for (s, b), (_, v) in zip(entries[1:], top)]})
        return {"content": content}

    # ------------------------------------------------------------------ completions
    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        self._require_ready()
        limits = self.limits
        params = completion_params(req, served_model_names=self.model_names,
                                   max_logprobs=self.max_logprobs, limits=limits)
        prompts = normalize_prompts(req.prompt)
        check_num_choices(len(prompts), req.n)
        if limits is not None:
            for i, p in enumerate(prompts):
                if isinstance(p, list):
                    try:
                        validate_prompt(p, limits, field="prompt" if len(prompts) == 1
                                        else f"prompt[{i}]")
                    except ValidationError as e:
                        raise validation_error(e) from e
        await self._compile_grammar(params, _structured_field(req))
        base = f"cmpl-{uuid.uuid4().hex}"
        reqs = [EngineRequest(f"{base}-{i}", p, params, priority=req.priority,
                              lora_name=self.lora_of(req.model))
                for i, p in enumerate(prompts)]
        group = await self._submit(reqs)
        try:
            echo = ([p if isinstance(p, str) else self.engine.engine.tokenizer.decode(p)
                     for p in prompts] if req.echo else None)
        except BaseException:
            group.abort()
            raise
        acc = _Acc(group, req.n)
        head = {"id": base, "object": "text_completion", "created": int(time.time()),
                "model": req.model or self.model_names[0]}
        if req.stream:
            return _GroupStream(self._stream_completion(group, acc, req, head, echo), group)
        if not await self._collect(group, acc, raw):
            return Response(status_code=499)
        if echo_without_generation(req):
            return JSONResponse(self._echo_only(acc, req, head, echo))
        choices = []
        for i, ch in enumerate(acc.choices):
            prefix = echo[i // req.n] if echo else ""
            lp = (self._logprobs_completion(ch, len(prefix)) if params.logprobs is not None
                  else None)
            if lp is not None and echo:
                lp = self._with_echo_logprobs(acc, i // req.n, params.logprobs, lp)
            c = {"index": i, "text": prefix + "".join(ch.text), "logprobs": lp,
                 "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason}
            if req.prompt_logprobs is not None:
                c["prompt_logprobs"] = self._vllm_prompt_logprobs(acc, i // req.n)
            choices.append(c)
        return JSONResponse({**head, "choices": choices, "usage": acc.usage()})

    @staticmethod
    async def _sse_stream(group, acc: _Acc, head: dict, opts: Any,
                          choices: AsyncIterator[dict]) -> AsyncIterator[str]:
        """The SSE framing both endpoints share: one chunk per choice delta (with
        `usage` when `stream_options.continuous_usage_stats`), the closing usage chunk
        (`include_usage`), an `APIError` as an error event, then `[DONE]`; the group is
        aborted however the stream ends (a client that disconnects frees its blocks)."""
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        try:
            async for choice in choices:
                c = {**head, "choices": [choice]}
                if include_usage:
                    c["usage"] = acc.usage() if continuous else None
                yield _sse(c)
            if include_usage:
                yield _sse({**head, "choices": [], "usage": acc.usage()})
        except APIError as e:
            yield _sse(e.to_dict())
        finally:
            group.abort()
        yield "data: [DONE]\n\n"

    def _stream_completion(self, group, acc: _Acc, req: CompletionRequest, head: dict,
                           echo: list[str] | None) -> AsyncIterator[str]:
        return self._sse_stream(group, acc, head, req.stream_options,
                                self._completion_deltas(group, acc, req, echo))

    async def _completion_deltas(self, group, acc: _Acc, req: CompletionRequest,
                                 echo: list[str] | None) -> AsyncIterator[dict]:
        def choice(idx: int, text: str, finish: str | None, logprobs=None, stop_reason=None):
            return {"index": idx, "text": text, "logprobs": logprobs, "finish_reason": finish,
                    "stop_reason": stop_reason}

        if echo_without_generation(req):
            async for d in group:
                acc.apply(d)
            body = self._echo_only(acc, req, {}, echo)
            for c in body["choices"]:
                yield c
            return
        # echo with logprobs waits for the prompt's logprobs (its first delta with tokens).
        echo_lp = bool(echo) and req.logprobs is not None
        echoed = [not echo_lp] * len(acc.prompt_ids)
        if echo and not echo_lp:
            for i in range(len(acc.choices)):
                yield choice(i, echo[i // req.n], None)
        async for d in group:
            p = acc.prompt_index.get(d.request_id)
            applied = acc.apply(d)
            if p is not None and not echoed[p] and acc.prompt_logprobs[p] is not None:
                echoed[p] = True
                lp = self._echo_logprobs(acc.prompt_ids[p], acc.prompt_logprobs[p], req.logprobs)
                for i in range(p * req.n, (p + 1) * req.n):
                    yield choice(i, echo[p], None, lp)
            for idx, c in applied:
                if not (c.text or c.token_ids or c.finish_reason):
                    continue
                lp = None
                if c.logprobs is not None:
                    tmp = _Choice(token_ids=list(c.token_ids), logprobs=list(c.logprobs))
                    lp = self._logprobs_completion(tmp, 0)
                yield choice(idx, c.text, c.finish_reason, lp, c.stop_reason)
