"""The one validator: every request field is checked here, once, at submission.

Issue 13's failures (`top_k=2**40` overflowing an int32 array inside the
step, out-of-vocabulary `stop_token_ids`) came from checks spread over the
sampler, the engine and the server, so a value could pass one and break the
next. Every field now has one declarative rule, and the same rules run for
`SamplingParams(...)` (model-free part), `LLMEngine.add_request` and the HTTP
server (model-dependent part, against `Limits`).

A rule is any object with `check(obj, limits)` that reads its field off
`obj` (a `SamplingParams` or a pydantic request body) and raises
`ValidationError`. Structured output (`StructuredOutputs`, `body_structured_outputs`)
is checked with llguidance's own grammar validator, so a bad schema, regex or
grammar is rejected here, before anything is queued. New fields (issue 17: `logit_bias`, `response_format`,
`priority`) are one more entry in a rule tuple, not a new code path.

Semantics follow vLLM where it has them: `top_k >= vocab_size` is "no top-k"
and is normalised to 0 (vLLM PR #14234); stop token ids must lie in the
vocabulary (vLLM PR #54196). Every integer that ends up in an int32 array
must fit int32; every float must be finite and still in range after its
float32 cast (1e-50 is > 0, but its float32 is 0.0).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from jaxserve.errors import ValidationError, quote  # noqa: F401 - re-exported

INT32_MAX = 2**31 - 1
# Seeds go into a 64-bit threefry key; vLLM keeps them below 2**63 (a signed int64).
SEED_MAX = 2**63 - 1
MAX_N = 16
# The sampler masks stop ids with a fixed-width array (sampling parameters are data).
MAX_STOP_TOKEN_IDS = 16
# Stop strings: bounded count and length, since the detokenizer scans a tail of
# the longest one on every token.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
# OpenAI's logit_bias: at most 300 token ids, each biased by a value in [-100, 100]. The
# sampler takes them as a fixed [S, 300] array pair (no compile per request).
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_LIMIT = 100.0
@dataclass(frozen=True)
class Limits:
    """What the served model and engine impose on a request.

    Args:
      vocab_size: V; token ids must lie in [0, V).
      max_model_len: positions of one request (prompt + output).
      max_logprobs: most top-logprobs one request may ask for.
      scheduling_policy: "fcfs" or "priority" (a non-zero priority needs "priority").
      enable_prompt_logprobs: the engine built its score programs (prompt_logprobs,
        echo with logprobs); off, asking for them is an error naming the flag.
    """

    vocab_size: int
    max_model_len: int
    max_logprobs: int = 20
    scheduling_policy: str = "fcfs"
    enable_prompt_logprobs: bool = True

    @classmethod
    def from_config(cls, config: Any) -> "Limits":
        """From an `EngineConfig` (model.vocab_size, scheduler.max_model_len and .policy,
        max_logprobs)."""
        return cls(vocab_size=int(config.model.vocab_size),
                   max_model_len=int(config.scheduler.max_model_len),
                   max_logprobs=int(getattr(config, "max_logprobs", 20)),
                   scheduling_policy=str(getattr(config.scheduler, "policy", "fcfs")),
                   enable_prompt_logprobs=bool(getattr(config, "enable_prompt_logprobs", True)))


class Rule(Protocol):
    """A check of one field of `obj`; `limits` is None for model-free checks."""

    field: str

    def check(self, obj: Any, limits: Limits | None) -> None: ...


def is_int(x: Any) -> bool:
    """A Python or NumPy integer, never a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def is_num(x: Any) -> bool:
    """An int or float (Python or NumPy), never a bool."""
    return is_int(x) or (isinstance(x, (float, np.floating)))


def _interval(lo, hi, lo_open: bool, hi_open: bool) -> str:
    if hi is None:
        return f"{'>' if lo_open else '>='} {lo}"
    return f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"


@dataclass(frozen=True)
class Range:
    """A scalar int or float field in an interval; an int without `hi` must fit `int_max`.

    Args:
      field: attribute name.
      kind: int or float.
      lo, hi: bounds (hi None: no upper bound beyond the dtype's).
      lo_open, hi_open: exclusive bounds.
      nullable: None is allowed (and means the documented default).
      note: appended to the message (what a special value means).
      model_hi: optional `limits -> (bound, name)`; the field must also be <= bound.
      int_max: the storage dtype's bound for an int without `hi` (int32 arrays); None for a
        field that is normalised before it is stored (top_k).
    """

    field: str
    kind: type
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    nullable: bool = False
    note: str = ""
    model_hi: Callable[[Limits], tuple[int, str]] | None = None
    int_max: int | None = INT32_MAX

    def _fail(self, v: Any, limit: str) -> ValidationError:
        return ValidationError(self.field, v, limit + (f" ({self.note})" if self.note else ""))

    def _in(self, v: float) -> bool:
        ok_lo = self.lo is None or (v > self.lo if self.lo_open else v >= self.lo)
        ok_hi = self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)
        return ok_lo and ok_hi

    def check(self, obj: Any, limits: Limits | None) -> None:
        v = getattr(obj, self.field)
        if v is None and self.nullable:
            return
        kind = "an int" if self.kind is int else "a number"
        want = f"must be {kind} {_interval(self.lo, self.hi, self.lo_open, self.hi_open)}"
        if self.nullable:
            want += " or null"
        if not (is_int(v) if self.kind is int else is_num(v)):
            raise self._fail(v, want)
        if self.kind is float:
            if not math.isfinite(v):
                raise self._fail(v, want + "; it must be finite")
            if not self._in(v):
                raise self._fail(v, want)
            f32 = float(np.float32(v))
            if not self._in(f32):  # the sampler computes in float32
                raise self._fail(v, f"{want}; it is {f32!r} as float32")
            return
        if not self._in(v):
            raise self._fail(v, want)
        if self.hi is None and self.int_max is not None and v > self.int_max:
            raise self._fail(v, f"{want} and <= {self.int_max} (int32)")
        if limits is not None and self.model_hi is not None:
            bound, name = self.model_hi(limits)
            if v > bound:
                raise self._fail(v, f"must be <= {name}={bound}")


@dataclass(frozen=True)
class Flag:
    """A bool field (True/False only: 0, 1 and "yes" are errors)."""

    field: str

    def check(self, obj: Any, limits: Limits | None) -> None:
        v = getattr(obj, self.field)
        if not isinstance(v, (bool, np.bool_)):
            raise ValidationError(self.field, v, "must be true or false")


def _check_count(field: str, items: Sequence[Any], max_len: int, what: str) -> Sequence[Any]:
    """`items` itself, after checking it is a list/tuple of at most `max_len` entries."""
    if not isinstance(items, (list, tuple)):
        raise ValidationError(field, items, f"must be a list of {what}")
    if len(items) > max_len:
        raise ValidationError(field, items, f"at most {max_len} {what} are supported, "
                              f"got {len(items)}")
    return items


@dataclass(frozen=True)
class TokenIds:
    """A list of token ids: at most `max_len` ints in [0, int32) and, given limits, < vocab_size."""

    field: str
    max_len: int

    def check(self, obj: Any, limits: Limits | None) -> None:
        ids = _check_count(self.field, getattr(obj, self.field), self.max_len, "ids")
        check_token_ids(self.field, ids, limits)


@dataclass(frozen=True)
class Strings:
    """A list of non-empty strings, bounded in count and length."""

    field: str
    max_len: int
    max_chars: int

    def check(self, obj: Any, limits: Limits | None) -> None:
        items = _check_count(self.field, getattr(obj, self.field), self.max_len, "strings")
        for i, s in enumerate(items):
            if not isinstance(s, str) or not s or len(s) > self.max_chars:
                raise ValidationError(f"{self.field}[{i}]", s, "must be a non-empty string of at "
                                      f"most {self.max_chars} characters")


@dataclass(frozen=True)
class Check:
    """A cross-field rule: `fn(obj, limits)` returns None or (value, limit text)."""

    field: str
    fn: Callable[[Any, Limits | None], tuple[Any, str] | None]

    def check(self, obj: Any, limits: Limits | None) -> None:
        bad = self.fn(obj, limits)
        if bad is not None:
            raise ValidationError(self.field, bad[0], bad[1])


def normalize_logit_bias(raw: Any) -> tuple[tuple[Any, Any], ...]:
    """`logit_bias` as sorted (token id, bias) pairs: from a dict (OpenAI's JSON has string
    keys, "50256") or from pairs. Values are left for the `LogitBias` rule.

    Raises:
      ValidationError: not a dict or pairs, a key that is not an integer, or an id twice.
    """
    if raw is None:
        return ()
    if isinstance(raw, dict):
        items = list(raw.items())
    elif isinstance(raw, (list, tuple)) and all(
            isinstance(x, (list, tuple)) and len(x) == 2 for x in raw):
        items = [tuple(x) for x in raw]
    else:
        raise ValidationError("logit_bias", raw, "must map token ids to biases")
    out: dict[int, Any] = {}
    for k, v in items:
        tid = k
        if isinstance(k, str) and k.strip().lstrip("-").isdigit():
            tid = int(k)
        if not is_int(tid):
            raise ValidationError(f"logit_bias[{k!r}]", k, "each key must be a token id "
                                  "(an integer)")
        if int(tid) in out:
            raise ValidationError(f"logit_bias[{k!r}]", k, f"token id {int(tid)} is given twice")
        out[int(tid)] = v
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class LogitBias:
    """(token id, bias) pairs: at most MAX_LOGIT_BIAS, ids in [0, vocab_size), biases
    in [-100, 100] (OpenAI's limits)."""

    field: str = "logit_bias"

    def check(self, obj: Any, limits: Limits | None) -> None:
        pairs = getattr(obj, self.field)
        if len(pairs) > MAX_LOGIT_BIAS:
            raise ValidationError(self.field, pairs, shown=f"<{len(pairs)} entries>",
                                  limit=f"at most {MAX_LOGIT_BIAS} entries are supported")
        hi, name = ((limits.vocab_size, "vocab_size") if limits is not None
                    else (INT32_MAX + 1, "2**31"))
        L = LOGIT_BIAS_LIMIT
        for tid, bias in pairs:
            if not 0 <= tid < hi:
                raise ValidationError(f"{self.field}[{tid}]", tid,
                                      f"the key must be a token id in [0, {name}={hi})")
            if not is_num(bias) or not math.isfinite(bias) or not -L <= bias <= L:
                raise ValidationError(f"{self.field}[{tid}]", bias,
                                      f"the bias must be a number in [{-L:g}, {L:g}]")


@dataclass(frozen=True)
class StructuredOutputs:
    """`SamplingParams.structured_outputs`: None or a `StructuredOutputsParams` whose spec
    llguidance accepts (`jaxserve.structured_output.check_spec`, cached per spec)."""

    field: str = "structured_outputs"

    def check(self, obj: Any, limits: Limits | None) -> None:
        v = getattr(obj, self.field)
        if v is None:
            return
        from jaxserve.structured_output import StructuredOutputsParams, check_spec

        if not isinstance(v, StructuredOutputsParams):
            raise ValidationError(self.field, v, "must be a StructuredOutputsParams (or a dict "
                                  "of its fields) or None")
        check_spec(v.spec, f"{self.field}.{v.spec.kind}")


@dataclass(frozen=True)
class StructuredBody:
    """The structured-output fields of an HTTP body (response_format, guided_json /
    _regex / _choice / _grammar, structured_outputs): at most one, well-formed, and a spec
    llguidance accepts (`jaxserve.structured_output.body_structured_outputs`)."""

    field: str = "response_format"

    def check(self, obj: Any, limits: Limits | None) -> None:
        from jaxserve.structured_output import body_structured_outputs

        body_structured_outputs(obj)


# The structured-output fields of an HTTP body (checked together: they conflict).
STRUCTURED_BODY_RULES: tuple[Rule, ...] = (StructuredBody(),)


def check_token_ids(field: str, ids: Sequence[Any], limits: Limits | None) -> None:
    """Each id is an int in [0, vocab_size) (or [0, int32) without limits).

    Raises:
      ValidationError: naming `field[i]`, the id and the bound.
    """
    hi, name = (limits.vocab_size, "vocab_size") if limits is not None else (INT32_MAX + 1, "2**31")
    for i, t in enumerate(ids):
        if not is_int(t) or not 0 <= t < hi:
            raise ValidationError(f"{field}[{i}]", t, f"must be a token id in [0, {name}={hi})")


def _min_le_max(p: Any, _: Limits | None):
    if p.max_tokens is not None and is_int(p.min_tokens) and p.min_tokens > p.max_tokens:
        return p.min_tokens, f"must be <= max_tokens={p.max_tokens}"
    return None


def _seed_room(p: Any, _: Limits | None):
    # Sample i of an n > 1 request uses seed + i (vLLM), which must stay a valid seed.
    if p.seed is not None and p.seed + p.n - 1 > SEED_MAX:
        return p.seed, f"seed + n - 1 must be <= {SEED_MAX} (sample i uses seed + i), n={p.n}"
    return None


def _logprobs_hi(lim: Limits) -> tuple[int, str]:
    return lim.max_logprobs, "max_logprobs"


def _prompt_logprobs_on(p: Any, lim: Limits | None):
    if lim is not None and p.prompt_logprobs is not None and not lim.enable_prompt_logprobs:
        return p.prompt_logprobs, ("needs an engine started with --enable_prompt_logprobs "
                                   "(EngineConfig.enable_prompt_logprobs=True)")
    return None


def _output_kind(p: Any, _: Limits | None):
    # RequestOutputKind (jaxserve.sampling_params): CUMULATIVE 0, DELTA 1, FINAL_ONLY 2.
    v = p.output_kind
    if not is_int(v) or int(v) not in (0, 1, 2):
        return v, "must be a RequestOutputKind: CUMULATIVE (0), DELTA (1) or FINAL_ONLY (2)"
    return None


def _len_hi(lim: Limits) -> tuple[int, str]:
    return lim.max_model_len, "max_model_len"


# Every field of SamplingParams, in declaration order, then the cross-field rules.
SAMPLING_RULES: tuple[Rule, ...] = (
    Range("n", int, 1, MAX_N),
    Range("max_tokens", int, 1, nullable=True, model_hi=_len_hi,
          note="null means up to max_model_len - prompt tokens"),
    Range("min_tokens", int, 0, model_hi=_len_hi),
    Range("temperature", float, 0.0, 100.0, note="0 is greedy"),
    # No upper bound: top_k >= vocab_size is normalised to 0 ("off") by `validate_sampling_params`.
    Range("top_k", int, -1, note="0 or -1 disables top-k", int_max=None),
    Range("top_p", float, 0.0, 1.0, lo_open=True),
    Range("min_p", float, 0.0, 1.0),
    Range("repetition_penalty", float, 0.0, 10.0, lo_open=True),
    Range("presence_penalty", float, -2.0, 2.0),
    Range("frequency_penalty", float, -2.0, 2.0),
    Range("seed", int, 0, SEED_MAX, nullable=True),
    Strings("stop", MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS),
    TokenIds("stop_token_ids", MAX_STOP_TOKEN_IDS),
    Flag("ignore_eos"),
    Range("logprobs", int, 0, nullable=True, model_hi=_logprobs_hi),
    Range("prompt_logprobs", int, 0, nullable=True, model_hi=_logprobs_hi),
    Flag("include_stop_str_in_output"),
    Flag("skip_special_tokens"),
    LogitBias("logit_bias"),
    StructuredOutputs("structured_outputs"),
    Check("min_tokens", _min_le_max),
    Check("seed", _seed_room),
    Check("prompt_logprobs", _prompt_logprobs_on),
    Check("output_kind", _output_kind),
)


def _priority_enabled(r: Any, lim: Limits | None):
    # vLLM rejects a non-zero priority unless the scheduler runs the priority policy.
    if lim is not None and r.priority != 0 and lim.scheduling_policy != "priority":
        return r.priority, (f"must be 0 unless the engine runs scheduling_policy='priority' "
                            f"(it runs {lim.scheduling_policy!r})")
    return None


# `priority` of a request (an HTTP body or `LLMEngine.add_request`): lower runs first; any
# Python int orders the heap, but vLLM's field is an int64.
PRIORITY_RULES: tuple[Rule, ...] = (
    Range("priority", int, -(2**63), 2**63 - 1, note="lower runs first under the priority policy"),
    Check("priority", _priority_enabled),
)


def run_rules(obj: Any, rules: Sequence[Rule], limits: Limits | None = None) -> None:
    """Apply `rules` to `obj` in order; the first failure raises.

    Raises:
      ValidationError: naming the field, the value and the limit.
    """
    for rule in rules:
        rule.check(obj, limits)


def validate_sampling_params(params: Any, limits: Limits | None = None) -> Any:
    """Check every field of a `SamplingParams`; return it normalised for `limits`' model.

    Without `limits` only model-free checks run (this is what
    `SamplingParams.__post_init__` does). With them, token ids are checked
    against the vocabulary, lengths against max_model_len, logprobs against
    max_logprobs, and `top_k >= vocab_size` becomes 0 (the same
    distribution: vLLM PR #14234), so the sampler's int32 array never
    overflows.

    Raises:
      ValidationError: naming the field, the value and the limit.
    """
    run_rules(params, SAMPLING_RULES, limits)
    if limits is not None and params.top_k >= limits.vocab_size:
        params = dataclasses.replace(params, top_k=0)
    return params


@dataclass(frozen=True)
class _Priority:
    priority: Any


def validate_priority(priority: Any, limits: Limits | None = None) -> None:
    """A request's `priority`: an int64, and 0 unless `limits.scheduling_policy == "priority"`.

    Raises:
      ValidationError: naming `priority`, the value and the policy.
    """
    run_rules(_Priority(priority), PRIORITY_RULES, limits)


def validate_prompt(ids: Sequence[Any], limits: Limits, *, field: str = "prompt") -> None:
    """A prompt's token ids: non-empty, in the vocabulary, and leaving room for one output token.

    Raises:
      ValidationError: naming `field`, the bad id or the length, and the limit.
    """
    if len(ids) == 0:
        raise ValidationError(field, [], "the prompt is empty (0 tokens): give at least one token")
    if len(ids) >= limits.max_model_len:
        raise ValidationError(
            field, ids, shown=f"<{len(ids)} tokens>",
            limit=f"prompt length {len(ids)} must be < max_model_len={limits.max_model_len} "
                  "(one position is needed for the first output token)")
    check_token_ids(field, ids, limits)
