"""Tool calling on the request side: checks, the grammar of `tool_choice`, template input.

- `tool_choice_mode`: which of vLLM's modes a body asks for, after checking `tools`
  (each a function with a non-empty, unique name and a parameters schema llguidance
  compiles) and `tool_choice` ("none", "auto", "required", or a named function that
  is in `tools`); every bad value is a 400 naming its field.
- `tool_structured_outputs`: `required` and a named function are enforced by the
  structured-output engine, in vLLM's JSON form: named -> the output is the
  function's arguments (a JSON value valid under its parameters schema); required ->
  `[{"name": ..., "parameters": {...}}, ...]` (one item when
  `parallel_tool_calls` is false), whatever the chat template knows about tools.
- `template_messages` / `render_chat`: the messages as the chat template wants them
  (transformers' conventions: `tool_calls[i].function.arguments` as an object,
  `tool_call_id` on tool results, `reasoning_content` on earlier turns) and the
  template rendered with `tools` and vLLM's `chat_template_kwargs`. A template that
  never mentions `tool_calls` (SmolLM2's) gets an assistant's calls written into its
  content as hermes markup, so a multi-turn agent conversation renders on any model.
"""

from __future__ import annotations

import json
from typing import Any

from jaxserve.server.protocol import APIError, ChatCompletionRequest, TokenizeChatRequest
from jaxserve.structured_output import GuidedSpec, StructuredOutputsParams, check_spec
from jaxserve.validation import ValidationError

# OpenAI's bounds: at most 128 tools, a function name of at most 64 characters.
MAX_TOOLS = 128
MAX_TOOL_NAME_CHARS = 64
TOOL_CHOICES = ("none", "auto", "required")
# Template variables the server sets itself; chat_template_kwargs may not override them.
RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                                    "tokenize", "bos_token", "eos_token", "continue_final_message"})
_EMPTY_PARAMS = {"type": "object", "properties": {}}
# The body's other structured-output fields (besides response_format).
_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                  "structured_outputs")


def _parameters(tool: Any) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else _EMPTY_PARAMS


def check_tools(tools: list | None) -> None:
    """Raises APIError(400, param="tools") for a bad `tools` list (see module doc)."""
    if not tools:
        return
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"tools has {len(tools)} entries; at most {MAX_TOOLS} are supported",
                       param="tools")
    seen = set()
    for i, t in enumerate(tools):
        if t.type != "function":
            raise APIError(400, f"tools[{i}].type={t.type!r} is not supported: only 'function' "
                           "tools are", param="tools")
        name = t.function.name
        if not name or len(name) > MAX_TOOL_NAME_CHARS:
            raise APIError(400, f"tools[{i}].function.name={name!r} must be 1 to "
                           f"{MAX_TOOL_NAME_CHARS} characters", param="tools")
        if name in seen:
            raise APIError(400, f"tools[{i}].function.name={name!r} is given twice",
                           param="tools")
        seen.add(name)
        field = f"tools[{i}].function.parameters"
        try:
            check_spec(GuidedSpec.make("json", _parameters(t), field=field), field)
        except ValidationError as e:
            raise APIError(400, str(e), param="tools") from e


def tool_choice_mode(req: ChatCompletionRequest, *, auto_enabled: bool = True
                     ) -> tuple[str, str | None]:
    """(mode, named function) of a body: mode is "none", "auto", "required" or "named".

    Raises:
      APIError(400, param="tools" | "tool_choice"): see module doc; also "auto" when the
        server runs with auto tool choice off, and required / named together with
        another structured-output field.
    """
    check_tools(req.tools)
    tc = req.tool_choice
    if tc is None:
        return ("auto" if req.tools and auto_enabled else "none"), None
    if isinstance(tc, str):
        if tc not in TOOL_CHOICES:
            raise APIError(400, f"tool_choice={tc!r} must be one of {TOOL_CHOICES} or "
                           "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
        mode, name = tc, None
    else:
        fn = tc.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tc.get("type", "function") != "function" or not isinstance(name, str):
            raise APIError(400, f"tool_choice={tc!r:.200} must be {{'type': 'function', "
                           "'function': {'name': <a tool's name>}}", param="tool_choice")
        mode = "named"
    if mode == "auto" and req.tools and not auto_enabled:
        raise APIError(400, 'tool_choice="auto" needs the server started with '
                       "--enable_auto_tool_choice", param="tool_choice")
    if mode in ("required", "named"):
        names = [t.function.name for t in req.tools or ()]
        if not names:
            raise APIError(400, f"tool_choice={tc!r:.100} needs a non-empty tools list",
                           param="tool_choice")
        if mode == "named" and name not in names:
            raise APIError(400, f"tool_choice names function {name!r}, which is not in tools "
                           f"{names[:20]}", param="tool_choice")
        rf = req.response_format
        guided = [f for f in _GUIDED_FIELDS if getattr(req, f) is not None]
        if guided or (rf is not None and rf.get("type") != "text"):
            raise APIError(400, f"tool_choice={tc!r:.100} is enforced with a grammar and cannot "
                           "be combined with response_format or guided_*", param="tool_choice")
    return mode, name


def required_schema(tools: list, *, parallel: bool) -> dict[str, Any]:
    """vLLM's JSON schema of `tool_choice="required"`: a non-empty array of
    `{"name": <a tool>, "parameters": <its arguments>}` (at most one item when not
    `parallel`), each tool's `$defs` hoisted to the top so its `$ref`s still resolve.

    Raises:
      APIError(400, param="tools"): two tools define the same `$defs` name differently.
    """
    defs: dict[str, Any] = {}
    items = []
    for t in tools:
        params = dict(_parameters(t))
        for k, v in params.pop("$defs", {}).items():
            if defs.setdefault(k, v) != v:
                raise APIError(400, f"tools define $defs[{k!r}] twice, differently; "
                               "tool_choice='required' needs one definition", param="tools")
        items.append({"type": "object", "properties": {
            "name": {"type": "string", "enum": [t.function.name]}, "parameters": params},
            "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def tool_structured_outputs(req: ChatCompletionRequest, mode: str,
                            name: str | None) -> StructuredOutputsParams | None:
    """The grammar of `required` / named tool choice (None for the other modes).

    Raises:
      APIError(400, param="tools"): the combined schema is too large or does not compile.
    """
    if mode == "named":
        schema = _parameters(next(t for t in req.tools if t.function.name == name))
    elif mode == "required":
        schema = required_schema(req.tools, parallel=req.parallel_tool_calls)
    else:
        return None
    try:
        check_spec(GuidedSpec.make("json", schema, field="tools"), "tools")
        return StructuredOutputsParams(json=schema)
    except ValidationError as e:
        raise APIError(400, str(e), param="tools") from e


def _hermes_markup(calls: list[dict[str, Any]]) -> str:
    return "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                   "arguments": c["function"]["arguments"]},
                                                  ensure_ascii=False) + "\n</tool_call>"
                     for c in calls)


def template_messages(req: ChatCompletionRequest | TokenizeChatRequest,
                      chat_template: str | None) -> list[dict[str, Any]]:
    """The messages as dicts for the chat template (see module doc).

    Raises:
      APIError(400, param="messages"): the list is empty, or a tool call's arguments
        are not a JSON object.
    """
    if not req.messages:
        raise APIError(400, "messages is empty: give at least one message", param="messages")
    knows_calls = "tool_calls" in (chat_template or "")
    out = []
    for i, m in enumerate(req.messages):
        if m.content is None:
            content = ""
        elif isinstance(m.content, str):
            content = m.content
        else:
            content = "".join(p.text for p in m.content)
        d: dict[str, Any] = {"role": m.role, "content": content}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None:
            d["reasoning_content"] = d["reasoning"] = reasoning
        if m.tool_calls:
            calls = []
            for j, c in enumerate(m.tool_calls):
                try:
                    args = json.loads(c.function.arguments)
                except ValueError:
                    args = None
                if not isinstance(args, dict):
                    raise APIError(400, f"messages[{i}].tool_calls[{j}].function.arguments="
                                   f"{c.function.arguments!r:.100} is not a JSON object",
                                   param="messages")
                calls.append({"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": args}})
            if knows_calls:
                d["tool_calls"] = calls
            else:
                d["content"] = (content + "\n" if content else "") + _hermes_markup(calls)
        out.append(d)
    return out


def template_kwargs(req: ChatCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
    """`tools` (as plain dicts) and `chat_template_kwargs` for `apply_chat_template`.

    Raises:
      APIError(400, param="chat_template_kwargs"): it sets a variable the server sets.
    """
    kw = dict(req.chat_template_kwargs or {})
    bad = sorted(RESERVED_TEMPLATE_VARS & set(kw))
    if bad:
        raise APIError(400, f"chat_template_kwargs may not set {bad}: the server sets them",
                       param="chat_template_kwargs")
    if req.tools:
        kw["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
    return kw


def render_chat(tok: Any, req: ChatCompletionRequest | TokenizeChatRequest, *,
                add_generation_prompt: bool = True) -> str:
    """The prompt text of a chat body: its messages, tools and template variables
    through the served model's chat template.

    Raises:
      APIError(400): no tokenizer, bad messages or kwargs, or a template that fails on
        them (param "messages").
    """
    if tok is None:
        raise APIError(400, "messages need a tokenizer, and this server has none (it was "
                       "built for token-id prompts)", param="messages")
    messages = template_messages(req, getattr(tok, "chat_template", None))
    kwargs = template_kwargs(req)
    try:
        return tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                       tokenize=False, **kwargs)
    except Exception as e:  # the template is user-driven: its TypeErrors are the body's fault
        raise APIError(400, f"the chat template failed on these messages: {e}",
                       param="messages") from e
