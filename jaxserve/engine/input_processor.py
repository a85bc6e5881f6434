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
from typing import Any, Container, Sequence

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.scheduler.request import Request
from jaxserve.sampling_params import SamplingParams
from jaxserve.validation import Limits, is_int, validate_priority, validate_sampling_params


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
                live_ids: Container[str], logprob_start: int | None = None
                ) -> ProcessedRequest:
        """Validate and build the request's children.

        Args:
          live_ids: the ids of the live user and child requests (taken ids).
          logprob_start: score prompt tokens from this index (`LLM.score`); else 1 when
            `params.prompt_logprobs` is set. Only sample 0 of an n > 1 request scores
            (the others may share the prompt's cached blocks).
        Raises:
          ValueError: a duplicate id, a bad sampling parameter, a prompt that is
            neither text, token ids nor messages, an empty prompt, a token id
            outside the vocabulary, stop strings without a tokenizer, or a
            logprob_start outside [1, prompt length).
        """
        if request_id in live_ids:
            raise ValueError(f"request_id={request_id!r} is already in use")
        # The one validator (jaxserve/validation.py): model-dependent checks + top_k clamp.
        params = validate_sampling_params(params or SamplingParams(), self.limits)
        validate_priority(priority, self.limits)  # non-zero only under the priority policy
        child_ids = child_request_ids(request_id, params.n)
        taken = [c for c in child_ids if c in live_ids]
        if taken:
            raise ValueError(f"request_id={request_id!r}: id {taken[0]!r} belongs to a live request")
        text, ids = self.prompt_ids(prompt, messages)
        if not ids:
            raise ValueError("the prompt is empty (0 tokens): give at least one token")
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer (stop strings match text)")
        if logprob_start is None and params.prompt_logprobs is not None:
            logprob_start = 1
        elif logprob_start is not None and not (is_int(logprob_start)
                                                and 1 <= logprob_start < len(ids)):
            raise ValueError(f"logprob_start={logprob_start!r} must be an int in [1, prompt "
                             f"length={len(ids)}) (token j is scored by the logits at j - 1)")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = []
        for i, cid in enumerate(child_ids):
            cp = params
            if params.n > 1:
                cp = params.replace(n=1, seed=None if params.seed is None else params.seed + i)
            children.append(Request(cid, ids, cp, eos_token_ids=self.eos_token_ids,
                                    arrival_time=arrival, priority=priority,
                                    logprob_start=logprob_start if i == 0 else None))
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
        if is_array(prompt):
            a = np.asarray(prompt)
            if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
                raise ValueError(f"an array prompt must be 1-D integer token ids, got shape "
                                 f"{a.shape} dtype {a.dtype}")
            prompt = a.tolist()
        if not isinstance(prompt, Sequence) or isinstance(prompt, bytes):
            raise ValueError(f"prompt must be a str or a sequence of token ids, got "
                             f"{type(prompt).__name__}")
        V = self.config.model.vocab_size
        ids = []
        for j, t in enumerate(prompt):
            try:
                if isinstance(t, (bool, np.bool_)):
                    raise TypeError
                t = operator.index(t)  # ints and NumPy integers
            except TypeError:
                raise ValueError(f"prompt[{j}]={t!r} is not an integer token id") from None
            if not 0 <= t < V:
                raise ValueError(f"prompt[{j}]={t} is outside [0, vocab_size={V})")
            ids.append(t)
        return None, ids

    def _need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise ValueError(f"{what} needs a tokenizer, and this engine was built without one")


def is_array(x: Any) -> bool:
    """A NumPy array or a jax.Array (duck-typed, so this module never imports jax)."""
    return isinstance(x, np.ndarray) or (hasattr(x, "__array__") and hasattr(x, "ndim")
                                         and hasattr(x, "dtype"))


def split_padded(tokens: Any, *, lengths: Any = None, mask: Any = None) -> list[np.ndarray]:
    """The rows of a right-padded token batch, each cut to its length.

    Args:
      tokens: int[B, T] (NumPy or jax.Array); row i's prompt is tokens[i, :len_i],
        the rest is padding (right padding; its values are ignored).
      lengths: int[B] prompt lengths in [0, T]; or
      mask: bool/int[B, T], 1 on prompt tokens; each row must be a prefix
        mask (1...1 0...0). Neither: every row is a full-length prompt.

    Returns: B 1-D int arrays.

    Raises:
      ValueError: non-integer or non-2-D tokens, both lengths and mask, a shape
        mismatch, a length outside [0, T] or a mask row that is not a prefix
        (naming the row and the position).
    """
    a = np.asarray(tokens)
    if a.ndim != 2 or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"a padded prompt batch must be int[B, T], got shape {a.shape} "
                         f"dtype {a.dtype}")
    B, T = a.shape
    if lengths is not None and mask is not None:
        raise ValueError("give prompt_lengths or prompt_mask, not both")
    if mask is not None:
        m = np.asarray(mask)
        if m.shape != a.shape:
            raise ValueError(f"prompt_mask has shape {m.shape}, the prompts {a.shape}")
        m = m.astype(bool)
        lens = m.sum(axis=1)
        wrong = m != (np.arange(T)[None, :] < lens[:, None])
        if wrong.any():
            row = int(np.nonzero(wrong.any(axis=1))[0][0])
            pos = int(np.nonzero(~m[row])[0][0])
            raise ValueError(f"prompt_mask row {row} is not a prefix mask: 0 at position {pos} "
                             f"before a later 1 (prompts are right-padded: 1...1 0...0)")
    elif lengths is not None:
        lens = np.asarray(lengths)
        if lens.shape != (B,) or not np.issubdtype(lens.dtype, np.integer):
            raise ValueError(f"prompt_lengths must be int[{B}], got shape {lens.shape} "
                             f"dtype {lens.dtype}")
        bad = np.nonzero((lens < 0) | (lens > T))[0]
        if bad.size:
            raise ValueError(f"prompt_lengths[{bad[0]}]={lens[bad[0]]} is outside [0, T={T}]")
    else:
        lens = np.full(B, T)
    return [a[i, :int(lens[i])] for i in range(B)]
