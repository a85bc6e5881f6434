"""Structured output: grammar specs, their compilation, and per-request matchers.

A request constrained by a JSON schema, a regex, a list of choices or a
Lark/GBNF grammar carries a `StructuredOutputsParams` (vLLM's name and
fields). Its spec is compiled by llguidance (Microsoft's Rust grammar engine,
github.com/guidance-ai/llguidance; chosen over xgrammar, which pulls torch, and
outlines-core, which has no context-free grammars: notes/structured_output.md)
into a matcher that, per step, writes the row's allowed-token bitmask
(int32 words, bit t of word t // 32 = token t) and advances by each accepted token.

Flow (vLLM V1's StructuredOutputManager, split the same way):
  - validation (`check_spec`): model-free grammar validation, cached, so a bad
    schema / regex / grammar is a 400 before anything is queued;
  - compilation (`GrammarCompiler.submit`): off the step loop in a small thread
    pool, cached by `GuidedSpec` (kind, canonical text), so a repeated schema is free;
    the engine holds a request until its grammar is ready;
  - per step (`GrammarMatcher.fill_bitmask` / `accept`): the runner fills the
    bitmask rows, the engine advances the matcher with the accepted token.

JSON is compact (no free whitespace between tokens: llguidance's
`whitespace_flexible=False`; vLLM's `disable_any_whitespace`), since a small
model can otherwise loop on whitespace forever. Importing this module does not
import llguidance; only compiling or validating a spec does.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import json
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from jaxserve.errors import ValidationError

# The spec kinds, in vLLM's StructuredOutputsParams field order.
KINDS = ("json", "regex", "choice", "grammar", "json_object")
# Bounds on one spec: the validator rejects larger ones (a 400, not a slow compile).
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 256
# Distinct compiled grammars kept (LRU); each holds a matcher in its start state.
GRAMMAR_CACHE_SIZE = 256
# JSON is compact: llguidance's default allows any whitespace between tokens.
_JSON_OPTIONS = {"whitespace_flexible": False}


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row: ceil(V / 32)."""
    return (vocab_size + 31) // 32


@dataclass(frozen=True)
class GuidedSpec:
    """One grammar spec: `kind` (one of KINDS) and its canonical text (the cache key).

    json: the schema as sorted-key JSON; regex / grammar: the text; choice: a JSON
    list of the choices; json_object: "" (any JSON object).
    """

    kind: str
    spec: str

    @classmethod
    def make(cls, kind: str, value: Any, *, field: str | None = None) -> "GuidedSpec":
        """Canonicalise a user value (a schema dict or JSON text, a regex, a list of choices,
        a grammar, True for json_object).

        Raises:
          ValidationError: naming `field` (default: the kind): wrong type, empty, too long,
            a schema that is not a JSON object, or a choice list that is empty / too long.
        """
        f = field or kind
        if kind not in KINDS:
            raise ValidationError(f, kind, f"must be one of {KINDS}")
        if kind == "json_object":
            if value is not True:
                raise ValidationError(f, value, "must be true")
            return cls(kind, "")
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise ValidationError(f, value, f"is not valid JSON: {e}") from None
            if not isinstance(value, dict):
                raise ValidationError(f, value, "must be a JSON schema (a JSON object)")
            text = json.dumps(value, sort_keys=True, separators=(",", ":"))
        elif kind == "choice":
            if not isinstance(value, (list, tuple)) or not value:
                raise ValidationError(f, value, "must be a non-empty list of strings")
            if len(value) > MAX_CHOICES:
                raise ValidationError(f, value, shown=f"<{len(value)} choices>",
                                      limit=f"at most {MAX_CHOICES} choices are supported")
            for i, c in enumerate(value):
                if not isinstance(c, str) or not c:
                    raise ValidationError(f"{f}[{i}]", c, "must be a non-empty string")
            text = json.dumps(list(value))
        else:
            if not isinstance(value, str) or not value.strip():
                raise ValidationError(f, value, f"must be a non-empty {kind} string")
            text = value
        if len(text) > MAX_SPEC_CHARS:
            raise ValidationError(f, value, shown=f"<{len(text)} characters>",
                                  limit=f"at most {MAX_SPEC_CHARS} characters are supported")
        return cls(kind, text)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's `StructuredOutputsParams` (SamplingParams.structured_outputs): exactly one of

    Args:
      json: a JSON schema (dict or JSON text); the output is one JSON value valid under it.
      regex: the output fullmatches this regex (Rust `regex` syntax, as llguidance parses it).
      choice: the output is exactly one of these strings.
      grammar: a Lark grammar (llguidance's dialect) or a GBNF/EBNF one (llama.cpp's `::=`).
      json_object: True: any JSON object (OpenAI's response_format json_object).

    Raises:
      ValidationError: none or several set, or a malformed value (see `GuidedSpec.make`);
        grammar validity is checked by `check_spec` (the validator's rule).
    """

    json: Any = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self):
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValidationError("structured_outputs", self, f"exactly one of {KINDS} must be "
                                  f"set, got {set_ or 'none'}")
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        spec = GuidedSpec.make(set_[0], getattr(self, set_[0]),
                               field=f"structured_outputs.{set_[0]}")
        if set_[0] == "json":  # hashable, canonical (the frozen SamplingParams hashes it)
            object.__setattr__(self, "json", spec.spec)
        object.__setattr__(self, "_spec", spec)

    @property
    def spec(self) -> GuidedSpec:
        return self._spec  # type: ignore[attr-defined]


def to_llguidance(spec: GuidedSpec) -> str:
    """The llguidance grammar text (its JSON TopLevelGrammar) of a spec. Does not validate."""
    import llguidance
    from llguidance import LLMatcher

    if spec.kind == "json":
        return LLMatcher.grammar_from_json_schema(spec.spec, defaults=_JSON_OPTIONS)
    if spec.kind == "json_object":
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.spec)
    if spec.kind == "choice":
        return llguidance.grammar_from("choice", spec.spec)
    return llguidance.grammar_from("grammar", spec.spec)  # Lark, or GBNF converted to Lark


@functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def spec_error(spec: GuidedSpec) -> str:
    """llguidance's error for a spec ("" when valid), without a tokenizer; cached."""
    from llguidance import LLMatcher

    try:
        grammar = to_llguidance(spec)
    except ValueError as e:  # GBNF that cannot be converted, a bad JSON argument
        return str(e)
    return LLMatcher.validate_grammar(grammar)


def check_spec(spec: GuidedSpec, field: str) -> None:
    """Raises ValidationError naming `field` when llguidance rejects the spec."""
    err = spec_error(spec)
    if err:
        # llguidance's message spans lines (source excerpts, carets): keep the words.
        lines = [ln.strip() for ln in err.splitlines() if ln.strip().strip("^|0123456789 ")]
        raise ValidationError(field, spec.spec, f"invalid {spec.kind}: {' '.join(lines)[:400]}")


# Where an HTTP body may ask for structured output: (field, StructuredOutputsParams kind).
# vLLM's guided_* extras, its newer `structured_outputs` object, and OpenAI's response_format.
GUIDED_FIELDS = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                 ("guided_grammar", "grammar"))


def _response_format(rf: Any) -> tuple[str, str, Any] | None:
    """(field, kind, value) of OpenAI's response_format, None for type text / absent."""
    if rf is None:
        return None
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", "json_object", True
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise ValidationError("response_format.json_schema.schema", schema,
                                  "must be a JSON schema object (response_format type "
                                  "'json_schema' needs json_schema.schema)")
        return "response_format.json_schema.schema", "json", schema
    raise ValidationError("response_format.type", kind,
                          "must be 'text', 'json_object' or 'json_schema'")


def structured_sources(body: Any) -> list[tuple[str, str, Any]]:
    """Every structured-output request of an HTTP body, as (field, kind, value).

    Raises:
      ValidationError: a malformed response_format, or a `structured_outputs` object
        with an unknown key.
    """
    out = []
    rf = _response_format(getattr(body, "response_format", None))
    if rf is not None:
        out.append(rf)
    for f, kind in GUIDED_FIELDS:
        if getattr(body, f, None) is not None:
            out.append((f, kind, getattr(body, f)))
    so = getattr(body, "structured_outputs", None)
    if so is not None:
        for k, v in so.items():
            if k not in KINDS:
                raise ValidationError(f"structured_outputs.{k}", v, f"unknown key: the "
                                      f"supported ones are {KINDS}")
            if v is not None and v is not False:
                out.append((f"structured_outputs.{k}", k, v))
    return out


def body_structured_outputs(body: Any) -> Any:
    """The `StructuredOutputsParams` an HTTP body asks for, or None; checked: at most one
    source, a well-formed value, a spec llguidance accepts.

    Raises:
      ValidationError: naming the field (a second source names the first it conflicts with).
    """
    src = structured_sources(body)
    if not src:
        return None
    if len(src) > 1:
        raise ValidationError(src[1][0], src[1][2], f"conflicts with {src[0][0]}: give one "
                              "structured-output field")
    field, kind, value = src[0]
    check_spec(GuidedSpec.make(kind, value, field=field), field)
    return StructuredOutputsParams(**{kind: value})


def is_grammar_error(message: str | None) -> bool:
    """Whether a request's error message is a structured-output failure (its grammar, not
    the server: the server answers it with a 400, not a 500)."""
    return "structured output" in (message or "")


class GrammarDeadEnd(RuntimeError):
    """A grammar row has no allowed token (or its matcher rejected a token): the
    request cannot go on and finishes with finish_reason "error" and this message."""


class GrammarMatcher:
    """One request's grammar state (an llguidance `LLMatcher`).

    `fill_bitmask` reads the state (no advance); `accept` advances it by one
    token. The engine calls `accept` only for tokens it keeps, so a failed or
    retried step never advances it, and a preemption by recompute keeps it
    (the output tokens are kept too).
    """

    __slots__ = ("_m", "spec", "bitmask_words")

    def __init__(self, matcher: Any, spec: GuidedSpec, vocab_size: int):
        self._m = matcher
        self.spec = spec
        self.bitmask_words = bitmask_words(vocab_size)  # width of `fill_bitmask`'s row

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the allowed tokens into `row` (int32[ceil(V/32)], C-contiguous).

        Raises:
          GrammarDeadEnd: the matcher is in an error state, or no token is allowed.
        """
        m = self._m
        if m.is_error():
            raise GrammarDeadEnd(f"structured output ({self.spec.kind}) failed: {self.error}")
        m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if m.is_error() or not row.any():
            raise GrammarDeadEnd(f"structured output ({self.spec.kind}) reached a dead end: no "
                                 f"token can continue the output ({self.error or 'empty mask'})")

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False when the grammar rejects it."""
        return bool(self._m.consume_token(int(token_id)))

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and nothing may follow (the request should stop)."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str:
        """llguidance's error, first line (its message goes on with a state dump), or ""."""
        err = self._m.get_error().strip()
        return err.splitlines()[0][:300] if err else ""


class _Compiled:
    """A compiled grammar: a matcher in its start state, copied per request."""

    def __init__(self, matcher: Any, spec: GuidedSpec, vocab_size: int):
        self._template, self.spec, self.vocab_size = matcher, spec, vocab_size

    def new_matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy(), self.spec, self.vocab_size)


def ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> Any:
    """An llguidance `LLTokenizer` over the model's vocabulary V (`vocab_size`).

    From the tokenizer's tokenizer.json when llguidance can read it (byte-level BPE, as
    SmolLM2/Llama/Qwen), else from each token's decoded bytes. Ids in [tokenizer
    vocab, V) have no bytes, so a grammar never allows them.
    """
    from llguidance import LLTokenizer, TokenizerWrapper

    eos = list(eos_token_ids) or None
    state = getattr(tokenizer, "to_state", None)
    if state is not None:
        try:
            return LLTokenizer(state()["tokenizer_json"], n_vocab=vocab_size, eos_token=eos)
        except Exception:  # e.g. a WordLevel model or a decoder llguidance cannot read
            pass

    class _Tokens:  # what llguidance's TokenizerWrapper reads
        def __init__(self):
            n = min(int(tokenizer.vocab_size), vocab_size)
            self.tokens = [tokenizer.decode([i], skip_special_tokens=False).encode()
                           for i in range(n)] + [b""] * (vocab_size - n)
            self.eos_token_id = eos[0] if eos else tokenizer.eos_token_id
            self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
            self.special_token_ids = list(getattr(tokenizer, "all_special_ids", ()))

        def __call__(self, s):
            # llguidance tokenizes forced text with this; a lossy encoding (an <unk> for a
            # character the vocabulary lacks) would make it allow the wrong token.
            text = s if isinstance(s, str) else s.decode("utf-8", "replace")
            ids = tokenizer.encode(text)
            return ids if tokenizer.decode(ids, skip_special_tokens=False) == text else []

    return LLTokenizer(TokenizerWrapper(_Tokens()), n_vocab=vocab_size, eos_token=eos)


class GrammarCompiler:
    """Compiles specs in a thread pool, cached by `GuidedSpec` (LRU of futures).

    Args:
      tokenizer: the engine's tokenizer (jaxserve's `Tokenizer` or one with
        vocab_size/decode/encode/eos_token_id).
      vocab_size: the model's V (the bitmask covers ceil(V/32) words).
      eos_token_ids: ids llguidance allows once the grammar accepts.
      max_workers: compile threads (llguidance drops the GIL while compiling).

    Thread-safe: the server validates/compiles from its request handlers while
    the engine thread takes matchers.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], *,
                 max_workers: int = 2):
        if tokenizer is None:
            raise ValueError("structured output needs a tokenizer (grammars match text)")
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers,
                                                           thread_name_prefix="jaxserve-grammar")
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[GuidedSpec, concurrent.futures.Future] = (
            collections.OrderedDict())
        self._ll_tok: Any = None
        self.num_compiled = 0

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tok is None:
                self._ll_tok = ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._ll_tok

    def _compile(self, spec: GuidedSpec) -> _Compiled:
        from llguidance import LLMatcher

        check_spec(spec, spec.kind)
        m = LLMatcher(self._tokenizer(), to_llguidance(spec), log_level=0)
        if m.is_error():
            raise ValidationError(spec.kind, spec.spec, f"invalid {spec.kind}: {m.get_error()}")
        # The first mask builds the lexer (the bulk of the cost): pay it here, not in a step.
        row = np.zeros(bitmask_words(self.vocab_size), np.int32)
        GrammarMatcher(m.deep_copy(), spec, self.vocab_size).fill_bitmask(row)
        self.num_compiled += 1
        return _Compiled(m, spec, self.vocab_size)

    def submit(self, spec: GuidedSpec) -> concurrent.futures.Future:
        """A future of the compiled grammar (done at once on a cache hit).

        Its exception is a ValidationError (invalid spec) or GrammarDeadEnd (a
        grammar no token of this vocabulary can start).
        """
        with self._lock:
            fut = self._cache.get(spec)
            if fut is not None:
                self._cache.move_to_end(spec)
                return fut
            fut = self._pool.submit(self._compile, spec)
            self._cache[spec] = fut
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
            return fut

    def matcher(self, spec: GuidedSpec) -> GrammarMatcher:
        """A fresh matcher in the start state (blocks until compiled; raises its error)."""
        return self.submit(spec).result().new_matcher()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
