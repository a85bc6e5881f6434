"""Per-request sampling parameters, validated on construction (vLLM semantics).

Sentinels follow vLLM: `temperature=0` is greedy; `top_k` of 0 or -1 means
"no top-k" (and `top_k >= vocab_size` is equivalent: the engine normalises it
to 0); `top_p=1` and `min_p=0` disable those filters. `ignore_eos` samples
EOS like any other token and merely does not stop on it; `min_tokens`
suppresses EOS and stop tokens until that many tokens exist.
`max_tokens=None` means "up to max_model_len". The text of the token that
stops a request (EOS or a stop token id) is not part of the output text unless
`include_stop_str_in_output`; its id stays in `token_ids` (vLLM).

`logit_bias` (OpenAI) adds a bias in [-100, 100] to the logits of up to 300
token ids before penalties and filtering (vLLM's order); a dict, stored as
sorted (id, bias) pairs.

`structured_outputs` (vLLM's `StructuredOutputsParams`: json / regex / choice /
grammar / json_object; a dict of those fields is accepted) constrains the output
to a grammar (`jaxserve.structured_output`).

`output_kind` (vLLM's `RequestOutputKind`): which steps return a `RequestOutput`, and
what it holds. CUMULATIVE (the default) returns one every step the request progresses,
with everything so far in `text` / `token_ids` / `logprobs` / `token_logprobs` and what
is new in the `delta_*` fields; DELTA returns the same outputs with only what is new in
those fields too (vLLM's meaning); FINAL_ONLY returns only the finished output, and no
per-step output is assembled (`LLM.generate` submits with it, as vLLM's does).

The rules live in `jaxserve.validation` (the one validator); construction
runs the model-free ones, `LLMEngine.add_request` the model-dependent ones.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

from jaxserve.validation import (MAX_N, MAX_STOP_TOKEN_IDS, normalize_logit_bias,
                                 validate_sampling_params)

__all__ = ["MAX_N", "MAX_STOP_TOKEN_IDS", "RequestOutputKind", "SamplingParams"]


class RequestOutputKind(enum.IntEnum):
    """Which steps give a request a `RequestOutput` (vLLM's enum, same values).

    CUMULATIVE: every step that adds a token; each output carries the cumulative token
    ids, text and logprobs and the deltas since the last output. DELTA: the same steps,
    with `text`, `token_ids`, `logprobs`, `token_logprobs` and `token_weight_versions`
    holding only what is new since the last output (`cumulative_logprob` stays
    cumulative). FINAL_ONLY: only the finished output; the engine skips the per-step
    assembly.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request (OpenAI / vLLM field names).

    Raises:
      jaxserve.validation.ValidationError (a ValueError): on construction,
        naming the field, the value and the limit it broke.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    # vLLM: None, or k >= 0 top alternatives per prompt token (the prompt token itself is
    # always included; the first prompt token has None). Teacher-forced, raw logprobs.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()  # a {token id: bias} dict is accepted
    structured_outputs: Any = None  # StructuredOutputsParams | None (a dict is accepted)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # an int 0-2 is accepted

    def __post_init__(self):
        # Normalise list inputs to tuples (the dataclass is frozen and hashable).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        object.__setattr__(self, "logit_bias", normalize_logit_bias(self.logit_bias))
        if isinstance(self.structured_outputs, dict):
            from jaxserve.structured_output import StructuredOutputsParams

            object.__setattr__(self, "structured_outputs",
                               StructuredOutputsParams(**self.structured_outputs))
        validate_sampling_params(self)
        object.__setattr__(self, "output_kind", RequestOutputKind(self.output_kind))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def replace(self, **kw: Any) -> "SamplingParams":
        return dataclasses.replace(self, **kw)
