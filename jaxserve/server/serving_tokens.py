"""POST /tokenize and /detokenize (vLLM's non-OpenAI routes, same shapes).

/tokenize takes a text `prompt` (BOS etc. added by default) or chat
`messages` (rendered by the served model's chat template exactly as
/v1/chat/completions renders them, so `count` is that request's
`prompt_tokens`) and answers `{"count", "max_model_len", "tokens",
"token_strs"}`; /detokenize takes `tokens` and answers `{"prompt"}` (special
tokens kept, as vLLM's `tokenizer.decode`). Both run on the event loop: the
Rust tokenizer takes microseconds for a prompt and never touches the engine
thread, so tokenizing never waits behind a step.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from jaxserve.server.chat_tools import render_chat, template_kwargs, template_messages
from jaxserve.server.protocol import (DETOKENIZE_RULES, APIError, DetokenizeRequest,
                                      TokenizeChatRequest, TokenizeCompletionRequest,
                                      check_model, validation_error)
from jaxserve.validation import ValidationError, run_rules


# A marker no real conversation holds; its trailing space shows whether the template
# trimmed what follows the content (then the content's own trailing space went too).
_CONTINUE_TAG = "\u2063JAXSERVE_CONTINUE_FINAL\u2063 "


def continue_final_message(tok: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """Render `messages` so the text ends right where the final message's content ends.

    transformers' `apply_chat_template(continue_final_message=True)`: the final
    content is rendered with a marker appended and the text is cut at the marker, so
    a trailing space or newline in the content is kept, an empty final message
    leaves its turn open, and the cut never lands inside the template's end-of-turn
    marker (a final "end" no longer matches inside "<|im_end|>"). A template that
    strips the content's trailing whitespace also strips it here.

    Args:
      tok: the served tokenizer (its `apply_chat_template(messages, ...,
        tokenize=False)` renders text).
      messages: `{"role", "content"}` dicts, the last one to be continued.
      kwargs: more template variables (`tools`, `chat_template_kwargs`).

    Raises:
      APIError(400, param="messages"): the template drops the final content.
    """
    tagged = [dict(m) for m in messages]
    tagged[-1]["content"] = str(tagged[-1]["content"]) + _CONTINUE_TAG
    text = tok.apply_chat_template(tagged, add_generation_prompt=False, tokenize=False, **kwargs)
    at = text.rfind(_CONTINUE_TAG.strip())
    if at < 0:
        raise APIError(400, "continue_final_message=true needs a final message whose content "
                       "appears in the rendered template", param="messages")
    if text.startswith(_CONTINUE_TAG, at):
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the content's trailing whitespace


class TokenizationServing:
    """Handlers of /tokenize and /detokenize over the `OpenAIServing`'s engine.

    Args:
      serving: the `OpenAIServing` (its engine, model names and limits).
    """

    def __init__(self, serving: Any):
        self.serving = serving

    def _tokenizer(self, model: str | None) -> Any:
        s = self.serving
        s._require_ready()
        check_model(model, s.model_names)
        tok = getattr(s.engine.engine, "tokenizer", None)
        if tok is None:
            raise APIError(400, "this server has no tokenizer (it was built for token-id "
                           "prompts only)")
        return tok

    def _chat_text(self, tok: Any, req: TokenizeChatRequest) -> str:
        if req.add_generation_prompt and req.continue_final_message:
            raise APIError(400, "add_generation_prompt=true and continue_final_message=true "
                           "cannot both be set (set add_generation_prompt=false)",
                           param="continue_final_message")
        if not req.continue_final_message:
            return render_chat(tok, req, add_generation_prompt=req.add_generation_prompt)
        messages = template_messages(req, tok.chat_template)
        try:
            return continue_final_message(tok, messages, **template_kwargs(req))
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e

    def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> JSONResponse:
        """The ids of a prompt or conversation, their count and the server's max_model_len."""
        tok = self._tokenizer(req.model)
        text = (self._chat_text(tok, req) if isinstance(req, TokenizeChatRequest)
                else req.prompt)
        ids = list(tok.encode(text, add_special_tokens=req.add_special_tokens))
        limits = self.serving.limits
        return JSONResponse({
            "count": len(ids), "max_model_len": limits.max_model_len if limits else None,
            "tokens": ids,
            "token_strs": tok.convert_ids_to_tokens(ids) if req.return_token_strs else None})

    def detokenize(self, req: DetokenizeRequest) -> JSONResponse:
        """The text of `tokens` (special tokens kept)."""
        tok = self._tokenizer(req.model)
        try:
            run_rules(req, DETOKENIZE_RULES, self.serving.limits)
        except ValidationError as e:
            raise validation_error(e) from e
        try:
            text = tok.decode(req.tokens, skip_special_tokens=False)
        except ValueError as e:  # an id the model has but the tokenizer lacks
            raise APIError(400, f"tokens: {e}", param="tokens") from e
        return JSONResponse({"prompt": text})
