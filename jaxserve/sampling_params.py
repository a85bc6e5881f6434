"""Per-request sampling parameters, validated on construction (vLLM semantics).

Sentinels follow vLLM: `temperature=0` is greedy; `top_k` of 0 or -1 means
"no top-k" (and `top_k >= vocab_size` is equivalent); `top_p=1` and
`min_p=0` disable those filters. `ignore_eos` samples EOS like any other token
and merely does not stop on it; `min_tokens` suppresses EOS and stop tokens
until that many tokens exist. `max_tokens=None` means "up to max_model_len".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# A request may name at most this many stop token ids: the sampler masks
# them with a fixed-width array (sampling parameters are data, never static).
MAX_STOP_TOKEN_IDS = 16
MAX_N = 16


def _bad(field: str, value: Any, limit: str) -> ValueError:
    return ValueError(f"SamplingParams.{field}={value!r}: {limit}")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request (OpenAI / vLLM field names).

    Raises:
      ValueError: on construction, naming the field and the limit it broke.
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
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self):
        # Normalise list inputs to tuples (the dataclass is frozen and hashable).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self._validate()

    def _validate(self) -> None:
        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x):
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise _bad("n", self.n, f"must be an int in [1, {MAX_N}]")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise _bad("max_tokens", self.max_tokens, "must be an int >= 1 (or None for max_model_len)")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise _bad("min_tokens", self.min_tokens, "must be an int >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", self.min_tokens, f"must be <= max_tokens={self.max_tokens}")
        if not is_num(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise _bad("temperature", self.temperature, "must be a number in [0, 100]")
        if not is_int(self.top_k) or self.top_k < -1:
            raise _bad("top_k", self.top_k, "must be an int >= -1 (0 or -1 disables top-k)")
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise _bad("top_p", self.top_p, "must be a number in (0, 1]")
        if not is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise _bad("min_p", self.min_p, "must be a number in [0, 1]")
        if not is_num(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 10.0:
            raise _bad("repetition_penalty", self.repetition_penalty, "must be a number in (0, 10]")
        for f in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, f)
            if not is_num(v) or not -2.0 <= v <= 2.0:
                raise _bad(f, v, "must be a number in [-2, 2]")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise _bad("seed", self.seed, "must be an int in [0, 2**63) or None")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise _bad("stop", self.stop, "must be non-empty strings")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise _bad("stop_token_ids", self.stop_token_ids, "must be non-negative ints")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise _bad("stop_token_ids", self.stop_token_ids,
                       f"at most {MAX_STOP_TOKEN_IDS} ids are supported")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            raise _bad("logprobs", self.logprobs, "must be an int >= 0 or None")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def replace(self, **kw: Any) -> "SamplingParams":
        return dataclasses.replace(self, **kw)
