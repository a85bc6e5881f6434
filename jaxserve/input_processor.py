"""Input processing: a user prompt becomes validated `Request`s (vLLM V1's Processor).

Text is tokenized, a chat conversation goes through the tokenizer's chat
template, token-id prompts are checked against the vocabulary, and the
`SamplingParams` go through the one validator (`jaxserve.validation`). A
request with `n > 1` fans out into n child `Request`s that share the prompt
(and, with prefix caching, its KV blocks); child i of a seeded request uses
seed + i (vLLM's convention). Nothing here touches the scheduler: every check
runs before anything is queued, so a rejected request leaks nothing.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from jaxserve.config import EngineConfig
from jaxserve.request import Request
from jaxserve.sampling_params import SamplingParams
from jaxserve.validation import Limits, validate_sampling_params


@dataclass
class ProcessedRequest:
    """A user request ready for the scheduler: its prompt and one Request per sample."""

    request_id: str
    prompt: str | None          # the text, when the prompt was text
    prompt_token_ids: list[int]
    children: list[Request]     # n of them; child i is sample i
    arrival_time: float


def child_request_ids(request_id: str, n: int) -> list[str]:
    """The scheduler-side ids of a request's n samples ("rid" alone when n == 1)."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


class InputProcessor:
    """Turns (prompt or messages, SamplingParams) into a `ProcessedRequest`.

    Args:
      config: the engine config (vocabulary, max_model_len, max_logprobs).
      tokenizer: a `jaxserve.checkpoint.tokenizer.Tokenizer`-like object, or None
        (token-id prompts only, no stop strings).
      eos_token_ids: the ids that end a request (model config + tokenizer).
    """

    def __init__(self, config: EngineConfig, tokenizer: Any, eos_token_ids: tuple[int, ...]):
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.limits = Limits.from_config(config)

    def process(self, request_id: str, prompt: str | Sequence[int] | None,
                params: SamplingParams | None, *, messages: Sequence[dict[str, Any]] | None,
                priority: int, arrival_time: float | None,
                is_live: Callable[[str], bool]) -> ProcessedRequest:
        """Validate and build the request's children.

        Args:
          is_live: whether an id already belongs to a live user or child request.
        Raises:
          ValueError: a duplicate id, a bad sampling parameter, a prompt that is
            neither text, token ids nor messages, an empty prompt, a token id
            outside the vocabulary, or stop strings without a tokenizer.
        """
        if is_live(request_id):
            raise ValueError(f"request_id={request_id!r} is already in use")
        # The one validator (jaxserve/validation.py): model-dependent checks + top_k clamp.
        params = validate_sampling_params(params or SamplingParams(), self.limits)
        child_ids = child_request_ids(request_id, params.n)
        taken = [c for c in child_ids if is_live(c)]
        if taken:
            raise ValueError(f"request_id={request_id!r}: id {taken[0]!r} belongs to a live request")
        text, ids = self.prompt_ids(prompt, messages)
        if not ids:
            raise ValueError("the prompt is empty (0 tokens): give at least one token")
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer (stop strings match text)")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = []
        for i, cid in enumerate(child_ids):
            cp = params
            if params.n > 1:
                cp = params.replace(n=1, seed=None if params.seed is None else params.seed + i)
            children.append(Request(cid, ids, cp, eos_token_ids=self.eos_token_ids,
                                    arrival_time=arrival, priority=priority))
        return ProcessedRequest(request_id, text, ids, children, arrival)

    def prompt_ids(self, prompt: str | Sequence[int] | None,
                   messages: Sequence[dict[str, Any]] | None) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a text, token-id or chat prompt.

        Raises:
          ValueError: not exactly one of prompt/messages, no tokenizer for text,
            empty messages, a non-integer or out-of-vocabulary token id.
        """
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt (text or token ids) and messages")
        if messages is not None:
            self._need_tokenizer("messages")
            if len(messages) == 0:
                raise ValueError("messages is empty: a chat request needs at least one message")
            ids = list(self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                                          tokenize=True))
            return None, ids
        if isinstance(prompt, str):
            self._need_tokenizer("a text prompt")
            return prompt, list(self.tokenizer.encode(prompt, add_special_tokens=True))
        if not isinstance(prompt, Sequence) or isinstance(prompt, bytes):
            raise ValueError(f"prompt must be a str or a sequence of token ids, got "
                             f"{type(prompt).__name__}")
        V = self.config.model.vocab_size
        ids = []
        for t in prompt:
            try:
                if isinstance(t, bool):
                    raise TypeError
                t = operator.index(t)  # ints and NumPy integers
            except TypeError:
                raise ValueError(f"prompt token id {t!r} is not an integer") from None
            if not 0 <= t < V:
                raise ValueError(f"prompt token id {t} is outside [0, vocab_size={V})")
            ids.append(t)
        return None, ids

    def _need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise ValueError(f"{what} needs a tokenizer, and this engine was built without one")
