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

from jaxserve.server.protocol import (DETOKENIZE_RULES, APIError, DetokenizeRequest,
                                      TokenizeChatRequest, TokenizeCompletionRequest,
                                      chat_messages, check_model, validation_error)
from jaxserve.validation import ValidationError, run_rules


def continue_final_message(text: str, messages: list[dict[str, str]]) -> str:
    """Cut a rendered conversation right after the final message's content.

    transformers' `continue_final_message`: the template's end-of-turn
    tokens after the last message are dropped, so the model continues that
    message instead of starting a new turn.

    Raises:
      APIError(400, param="messages"): the final content is empty or not in the text.
    """
    final = messages[-1]["content"].strip()
    at = text.rfind(final) if final else -1
    if at < 0:
        raise APIError(400, "continue_final_message=true needs a final message whose content "
                       "appears in the rendered template", param="messages")
    return text[:at + len(final)]


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
        messages = chat_messages(req)
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                           tokenize=False)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e
        return continue_final_message(text, messages) if req.continue_final_message else text

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
