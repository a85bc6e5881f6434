"""OpenAI request bodies (pydantic) and their translation to `SamplingParams`.

The models follow the OpenAI REST reference for `/v1/completions` and
`/v1/chat/completions`, plus vLLM's non-OpenAI sampling fields (top_k, min_p,
min_tokens, ignore_eos, repetition_penalty, stop_token_ids,
include_stop_str_in_output, priority) accepted in the same body, and OpenAI's
`logit_bias` ({"token id": bias}, checked by `jaxserve.validation.LogitBias`).
Structured output on both endpoints: OpenAI's `response_format` (text, json_object,
json_schema), vLLM's `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar` and its newer `structured_outputs` object; at most one of them
(`jaxserve.validation.StructuredBody`).
vLLM's /tokenize and /detokenize bodies are here too (`TokenizeRequest`,
`DetokenizeRequest`). Models are
`strict`: a JSON value of the wrong type (a string for `max_tokens`, `true` for
a token id) is a 400, never silently coerced. Unknown fields are ignored, as in
OpenAI's API.

max_tokens policy: `max_tokens` (or chat `max_completion_tokens`) must be an
int >= 1, else 400 naming the field (except completions' `echo: true` with
`max_tokens: 0`: the prompt alone, see `echo_without_generation`); omitted or null means "until EOS / stop,
at most max_model_len - prompt_tokens" (the engine clamps) on both endpoints;
unlike OpenAI's legacy completions default of 16. A prompt that leaves no room
for one output token (prompt_tokens >= max_model_len) is a 400 from the engine.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Tag

from jaxserve.sampling_params import SamplingParams
from jaxserve.structured_output import body_structured_outputs
from jaxserve.validation import (PRIORITY_RULES, STRUCTURED_BODY_RULES, Limits, TokenIds,
                                 ValidationError, run_rules, validate_sampling_params)

# Most choices (prompts x n) one HTTP request may ask for: a bound on the
# work one body can enqueue, so a single request cannot flood the scheduler.
MAX_CHOICES_PER_REQUEST = 256


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {message, type, param, code}}`.

    Args:
      status: HTTP status code (400, 401, 404, 500, 503).
      message: human-readable text naming the bad value and the limit it broke.
      param: the request field at fault, or None.
      err_type: OpenAI error type ("invalid_request_error", ...).
      code: optional machine code ("model_not_found", ...).
      headers: extra response headers (Retry-After on a 503 overload).
    """

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 err_type: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type or _DEFAULT_TYPES.get(status, "invalid_request_error")
        self.code = code

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type,
                          "param": self.param, "code": self.code}}


_DEFAULT_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                  404: "not_found_error", 405: "invalid_request_error",
                  500: "internal_server_error", 503: "service_unavailable"}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False
    # vLLM extension: a cumulative `usage` object on every chunk.
    continuous_usage_stats: bool = False


class _SamplingFields(_Strict):
    """Fields shared by both endpoints (OpenAI ones and vLLM's extras)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int = 0
    min_p: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    # structured output (OpenAI's response_format; vLLM's guided_* and structured_outputs)
    response_format: dict[str, Any] | None = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields):
    """Body of POST /v1/completions.

    `prompt` is a string, a list of strings, a list of token ids, or a list of
    token-id lists; each prompt becomes one engine request and contributes `n`
    choices, indexed `prompt_index * n + sample_index`.
    """

    prompt: Union[str, list[str], list[int], list[list[int]]]
    # None (not OpenAI's legacy 16): "up to max_model_len - prompt tokens", see module doc.
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool = False
    # vLLM extra: top-k logprobs of every prompt token (teacher-forced; the first is None).
    prompt_logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Strict):
    name: str
    arguments: str  # JSON text (OpenAI); parsed to an object for the chat template


class MessageToolCall(_Strict):
    """An assistant message's `tool_calls[i]` (OpenAI's shape)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    """One message. Assistant messages may carry `tool_calls` (content then optional) and
    their earlier reasoning (`reasoning`, vLLM; `reasoning_content`, DeepSeek); tool
    results are `role: "tool"` with an optional `tool_call_id`."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class ChatTool(_Strict):
    """One entry of `tools`; only `type: "function"` is served (checked in chat_tools)."""

    type: str = "function"
    function: FunctionDefinition


class ChatCompletionRequest(_SamplingFields):
    """Body of POST /v1/chat/completions (messages go through the chat template)."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # Tool calling (jaxserve.server.chat_tools): tool_choice is "none" | "auto" | "required"
    # | {"type": "function", "function": {"name": ...}}; None: "auto" with tools, else "none".
    tools: list[ChatTool] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool = True
    # vLLM: extra variables for the chat template (Qwen3's enable_thinking).
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's field; not served on chat (a 400 rather than dropped): use /v1/completions.
    prompt_logprobs: int | None = None


class TokenizeCompletionRequest(_Strict):
    """Body of POST /tokenize with a text prompt (vLLM's TokenizeCompletionRequest)."""

    model: str | None = None
    prompt: str
    # vLLM: text prompts get the tokenizer's special tokens (BOS) by default.
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Strict):
    """Body of POST /tokenize with chat messages (vLLM's TokenizeChatRequest).

    The template is rendered as for /v1/chat/completions; `add_special_tokens`
    defaults to False because the template already writes BOS (vLLM).
    """

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ChatTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False
    return_token_strs: bool | None = False


def _tokenize_kind(body: Any) -> str:
    # A body with "messages" is the chat form (vLLM's union has the same two shapes).
    return "chat" if isinstance(body, dict) and "messages" in body else "completion"


TokenizeRequest = Annotated[Union[Annotated[TokenizeCompletionRequest, Tag("completion")],
                                  Annotated[TokenizeChatRequest, Tag("chat")]],
                            Discriminator(_tokenize_kind)]


class DetokenizeRequest(_Strict):
    """Body of POST /detokenize (vLLM's DetokenizeRequest); answered as {"prompt": text}."""

    model: str | None = None
    tokens: list[int]


def normalize_prompts(prompt: Any) -> list[str | list[int]]:
    """Split a completions `prompt` into one entry per engine request.

    Raises:
      APIError(400, param="prompt"): the prompt (or any entry) is empty.
    """
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif len(prompt) == 0:
        raise APIError(400, "prompt is empty: give a non-empty string or token-id list",
                       param="prompt")
    elif isinstance(prompt[0], int):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
    for i, p in enumerate(prompts):
        if len(p) == 0:
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            raise APIError(400, f"{where} is empty: a request needs at least one prompt token",
                           param="prompt")
        if isinstance(p, list) and any(t < 0 for t in p):
            raise APIError(400, f"prompt token ids must be >= 0, got {min(p)}", param="prompt")
    return prompts


# Body fields that are not SamplingParams fields, checked by the same validator.
BODY_RULES = PRIORITY_RULES + STRUCTURED_BODY_RULES


# Most ids one /detokenize body may carry: a bound on the work of one request.
MAX_DETOKENIZE_TOKENS = 1 << 20
DETOKENIZE_RULES = (TokenIds("tokens", MAX_DETOKENIZE_TOKENS),)


def validation_error(e: ValidationError, *, rename: dict[str, str] | None = None) -> APIError:
    """The 400 of a validator error: the same text, `param` the top-level field."""
    param = (rename or {}).get(e.param, e.param)
    msg = str(e)
    if param != e.param:
        msg = param + msg[len(e.param):]
    return APIError(400, msg, param=param)


def check_model(model: str | None, served_model_names: list[str]) -> None:
    """Raises APIError(400, param="model", code="model_not_found") for a name not served."""
    if model is not None and model not in served_model_names:
        raise APIError(400, f"model={model!r} does not exist; this server serves "
                       f"{served_model_names}", param="model", code="model_not_found")


def _check_common(req: _SamplingFields, served_model_names: list[str],
                  limits: Limits | None) -> None:
    check_model(req.model, served_model_names)
    if req.stream_options is not None and not req.stream:
        # OpenAI and vLLM: stream_options only make sense for a streamed response.
        raise APIError(400, "stream_options is only allowed when stream is true",
                       param="stream_options")
    try:
        run_rules(req, BODY_RULES, limits)
    except ValidationError as e:
        raise validation_error(e) from e


def _build_params(req: _SamplingFields, *, max_tokens: int | None, max_tokens_field: str,
                  logprobs: int | None, limits: Limits | None,
                  prompt_logprobs: int | None = None,
                  prompt_logprobs_field: str = "prompt_logprobs", structured_outputs: Any = None,
                  skip_special_tokens: bool | None = None) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if skip_special_tokens is None:
        skip_special_tokens = req.skip_special_tokens
    try:
        if structured_outputs is None:
            structured_outputs = body_structured_outputs(req)
        params = SamplingParams(
            n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=req.top_k, top_p=1.0 if req.top_p is None else req.top_p, min_p=req.min_p,
            repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, seed=req.seed, stop=tuple(stop),
            stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=skip_special_tokens, logit_bias=req.logit_bias,
            structured_outputs=structured_outputs)
        return validate_sampling_params(params, limits)
    except ValidationError as e:
        raise validation_error(e, rename={"max_tokens": max_tokens_field,
                                          "prompt_logprobs": prompt_logprobs_field}) from e


def completion_params(req: CompletionRequest, *, served_model_names: list[str],
                      max_logprobs: int, limits: Limits | None = None) -> SamplingParams:
    """Validate a completions body and build its `SamplingParams`.

    `limits` (the served model's) adds the model-dependent checks of
    `jaxserve.validation` (token ids in the vocabulary, lengths, top_k clamp).

    Raises:
      APIError(400): naming the bad field (model, n, max_tokens, logprobs, echo, ...).
    """
    _check_common(req, served_model_names, limits)
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, f"best_of={req.best_of} is not supported (only best_of == n)",
                       param="best_of")
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.logprobs is not None and not 0 <= req.logprobs <= max_logprobs:
        raise APIError(400, f"logprobs={req.logprobs} is out of range: must be in "
                       f"[0, {max_logprobs}]", param="logprobs")
    # echo with logprobs prepends the prompt tokens' logprobs (OpenAI): the scoring path,
    # as prompt_logprobs=logprobs (an explicit prompt_logprobs wins for the vLLM field).
    prompt_lps, field = req.prompt_logprobs, "prompt_logprobs"
    if req.echo and req.logprobs is not None:
        if prompt_lps is None:
            field = "echo"
        prompt_lps = max(prompt_lps or 0, req.logprobs)
    # echo with max_tokens=0 (lm-eval's loglikelihood): the engine runs one token, the
    # server returns the prompt alone (vLLM's echo_without_generation, its PR #44938).
    max_tokens = 1 if echo_without_generation(req) else req.max_tokens
    return _build_params(req, max_tokens=max_tokens, max_tokens_field="max_tokens",
                         logprobs=req.logprobs, limits=limits, prompt_logprobs=prompt_lps,
                         prompt_logprobs_field=field)


def echo_without_generation(req: CompletionRequest) -> bool:
    """`echo: true` with `max_tokens: 0`: the choice is the prompt alone (its text, and its
    prompt logprobs when `logprobs` is set, the first null), no completion tokens (vLLM)."""
    return bool(req.echo) and req.max_tokens == 0


def chat_params(req: ChatCompletionRequest, *, served_model_names: list[str],
                max_logprobs: int, limits: Limits | None = None,
                structured_outputs: Any = None,
                skip_special_tokens: bool | None = None) -> SamplingParams:
    """Validate a chat body and build its `SamplingParams`.

    `max_completion_tokens` wins over the deprecated `max_tokens` when both are set.
    `structured_outputs` (the grammar of `tool_choice` required / named) replaces the
    body's; `skip_special_tokens`, when set, the body's (a tool parser whose tags are
    special tokens needs them kept).

    Raises:
      APIError(400): naming the bad field.
    """
    _check_common(req, served_model_names, limits)
    if req.prompt_logprobs is not None:
        raise APIError(400, f"prompt_logprobs={req.prompt_logprobs} is not supported on "
                       f"/v1/chat/completions; use /v1/completions", param="prompt_logprobs")
    logprobs = None
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        if not 0 <= req.top_logprobs <= max_logprobs:
            raise APIError(400, f"top_logprobs={req.top_logprobs} is out of range: must be in "
                           f"[0, {max_logprobs}]", param="top_logprobs")
    if req.logprobs:
        logprobs = req.top_logprobs or 0
    if req.max_completion_tokens is not None:
        max_tokens, field = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, field = req.max_tokens, "max_tokens"
    return _build_params(req, max_tokens=max_tokens, max_tokens_field=field, logprobs=logprobs,
                         limits=limits, structured_outputs=structured_outputs,
                         skip_special_tokens=skip_special_tokens)


def check_num_choices(num_prompts: int, n: int) -> None:
    """Raises APIError(400, param="prompt") when prompts x n exceeds the per-request cap."""
    if num_prompts * n > MAX_CHOICES_PER_REQUEST:
        raise APIError(400, f"{num_prompts} prompts x n={n} = {num_prompts * n} choices exceeds "
                       f"the limit of {MAX_CHOICES_PER_REQUEST} per request", param="prompt")
