"""Tokenizer wrapper over HF `tokenizers`, built from tokenizer.json or GGUF metadata.

The duck-typed interface the rest of jaxserve relies on (see the brief):
encode, decode, convert_ids_to_tokens, apply_chat_template, bos_token_id,
eos_token_id, vocab_size, all_special_ids, chat_template.

Chat templates are rendered the way transformers does (`render_jinja_template`):
a sandboxed jinja2 environment with trim_blocks/lstrip_blocks, the
loopcontrols extension, the `{% generation %}` block (rendered as its body;
transformers uses it only to track assistant-token masks), a `tojson`
filter, `raise_exception` and `strftime_now`, and the variables `messages`,
`add_generation_prompt`, `bos_token`, `eos_token`, `tools`, `documents`.
A template is compiled and rendered once on a probe conversation when the
tokenizer is built, so a template using something this environment lacks (an
unknown tag, filter, test or function) is a CheckpointError at load, not at
the first request.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any, Sequence

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from jaxserve.checkpoint.errors import CheckpointError

# GGUF `tokenizer.ggml.token_type` values (llama.cpp `llama_token_type`).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# GPT-2's split regex; llama.cpp's "gpt2"-family pre-tokenizers use it as is.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Qwen2's tokenizer.json regex (llama.cpp LLAMA_VOCAB_PRE_TYPE_QWEN2, also Qwen2.5/Qwen3):
# Llama 3's, but every digit is its own piece.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")

# llama.cpp `tokenizer.ggml.pre` names -> HF pre-tokenizer. The "smollm" family
# (llama.cpp: STARCODER/REFACT/COMMAND_R/SMOLLM/CODESHELL/EXAONE/MINERVA) first
# isolates every digit (`\p{N}`), then applies the GPT-2 regex; that is exactly
# SmolLM2's tokenizer.json: Sequence[Digits(individual_digits), ByteLevel].
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_GPT2_ONLY = ("gpt2", "default", "mpt", "olmo", "jais")
_LLAMA3 = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3")
_QWEN2 = ("qwen2",)


def _gguf_pre_tokenizer(pre: str, source: Path):
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in _GPT2_ONLY:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _LLAMA3 or pre in _QWEN2:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT if pre in _LLAMA3 else _QWEN2_SPLIT),
                                 behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise CheckpointError(
        f"{source}: unsupported tokenizer.ggml.pre={pre!r} (supported: "
        f"{sorted(_DIGITS_THEN_GPT2 + _GPT2_ONLY + _LLAMA3 + _QWEN2)})")


class TemplateRaised(jinja2.exceptions.TemplateError):
    """The template's own `raise_exception(...)` (e.g. roles that do not alternate)."""


# Gemma's turn format (Gemma 3's tokenizer_config.json template, text only): a system
# message is prefixed to the first user turn; "assistant" is spoken as "model".
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")


def _spm_backend(tokens: list[str], scores: list[float], types: list[int], fields: dict,
                 source: Path) -> tokenizers.Tokenizer:
    """A SentencePiece-BPE vocabulary (GGUF "llama" tokenizer: tokens + scores) as an HF
    BPE: the merge of two pieces ranks by the score of the piece it makes, which is the
    order SentencePiece's (and llama.cpp's `llm_tokenizer_spm`) bigram merging takes;
    transformers' SentencePieceExtractor derives Gemma's tokenizer.json merges the same
    way. Spaces are "\u2581" (no pre-tokenizer, no prefix space unless
    `tokenizer.ggml.add_space_prefix`), unknown characters fall back to <0xXX> bytes."""
    vocab = {t: i for i, t in enumerate(tokens)}
    normal = [i for i, ty in enumerate(types) if ty in (1, 6) and len(tokens[i]) > 1]
    ranked = []
    for i in normal:
        t = tokens[i]
        for j in range(1, len(t)):
            a, b = t[:j], t[j:]
            if a in vocab and b in vocab:
                ranked.append((-scores[i], i, a, b))
    ranked.sort()
    backend = tokenizers.Tokenizer(models.BPE(vocab, [(a, b) for _, _, a, b in ranked],
                                              unk_token=tokens[fields.get(
                                                  "tokenizer.ggml.unknown_token_id", 0)],
                                              fuse_unk=True, byte_fallback=True))
    from tokenizers import normalizers

    norm = [normalizers.Replace(" ", "\u2581")]
    if fields.get("tokenizer.ggml.add_space_prefix"):
        norm.insert(0, normalizers.Prepend("\u2581"))
    backend.normalizer = normalizers.Sequence(norm)
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
    return backend


def _raise_exception(message: str):
    raise TemplateRaised(message)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' AssistantTracker tag): the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


# A conversation every chat template should accept: user / assistant / user, then the prompt.
_PROBE = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi."},
          {"role": "user", "content": "What is 2 + 2?"}]


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators=None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _compile_template(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


def _checked_template(template: str, source: str | Path) -> jinja2.Template:
    """Compile a chat template and render `_PROBE` with it once.

    The template's own `raise_exception` (a deliberate refusal of the probe's
    roles) is accepted; any other failure is the environment lacking a feature.

    Raises:
      CheckpointError: a syntax error, an unknown tag/filter/test (compile time)
        or an undefined function / unsafe access while rendering, naming the source.
    """
    try:
        compiled = _compile_template(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise CheckpointError(f"{source}: chat template does not compile (line {e.lineno}): "
                              f"{e.message}") from e
    try:
        compiled.render(messages=_PROBE, add_generation_prompt=True, bos_token="", eos_token="",
                        tools=None, documents=None)
    except TemplateRaised:
        pass
    except Exception as e:  # UndefinedError, SecurityError, TypeError from a template's own code
        raise CheckpointError(f"{source}: chat template fails on a probe conversation "
                              f"(user/assistant/user): {type(e).__name__}: {e}") from e
    return compiled


class Tokenizer:
    """A byte-level BPE tokenizer plus its special tokens and chat template.

    Wraps a `tokenizers.Tokenizer` (HF's Rust tokenizer library). Build one
    with `Tokenizer.from_hf_dir` (tokenizer.json + tokenizer_config.json) or
    `Tokenizer.from_gguf_fields` (llama.cpp GGUF metadata).

    Attributes:
      bos_token_id / eos_token_id: int or None.
      vocab_size: number of ids, including added/special tokens.
      all_special_ids: sorted ids of special (control) tokens.
      chat_template: jinja2 source, or None.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token: str | None,
                 eos_token: str | None, chat_template: str | None, source: str | Path = "<memory>"):
        self._tok = backend
        self.source = str(source)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = None if bos_token is None else backend.token_to_id(bos_token)
        self.eos_token_id = None if eos_token is None else backend.token_to_id(eos_token)
        for name, t, i in (("bos", bos_token, self.bos_token_id), ("eos", eos_token, self.eos_token_id)):
            if t is not None and i is None:
                raise CheckpointError(f"{source}: {name}_token {t!r} is not in the vocabulary")
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.all_special_ids = sorted(i for i, t in backend.get_added_tokens_decoder().items()
                                      if t.special)
        self.chat_template = chat_template
        self._template = _checked_template(chat_template, source) if chat_template else None

    # -- constructors -----------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, directory: str | Path) -> "Tokenizer":
        """Load tokenizer.json (+ tokenizer_config.json, chat_template.jinja) from an HF dir.

        Raises:
          CheckpointError: tokenizer.json is missing or unreadable.
        """
        d = Path(directory)
        tj = d / "tokenizer.json"
        if not tj.is_file():
            raise CheckpointError(f"{d}: no tokenizer.json (only fast-tokenizer checkpoints are supported)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tj))
        except Exception as e:  # the Rust side raises a bare Exception on bad JSON
            raise CheckpointError(f"{tj}: cannot parse tokenizer.json: {e}") from e
        cfg = {}
        if (d / "tokenizer_config.json").is_file():
            cfg = json.loads((d / "tokenizer_config.json").read_text())
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()

        def content(v):
            return v.get("content") if isinstance(v, dict) else v

        return cls(backend, bos_token=content(cfg.get("bos_token")),
                   eos_token=content(cfg.get("eos_token")), chat_template=template, source=d)

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any], source: str | Path) -> "Tokenizer":
        """Build from decoded GGUF metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`).

        `tokenizer.ggml.model` "gpt2" (byte-level BPE with merges) or "llama"
        (SentencePiece BPE with scores: Gemma, `_spm_backend`). Control tokens
        (type 3) become special added tokens, user-defined ones (type 4) plain
        added tokens, so both are matched whole in text.

        Raises:
          CheckpointError: missing tokenizer metadata or an unsupported model / pre-tokenizer.
        """
        model = fields.get("tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise CheckpointError(f"{source}: unsupported tokenizer.ggml.model={model!r} "
                                  "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE)")
        tokens = fields.get("tokenizer.ggml.tokens")
        merges = fields.get("tokenizer.ggml.merges")
        types = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens or ())
        if model == "llama":
            scores = fields.get("tokenizer.ggml.scores")
            if not tokens or scores is None:
                raise CheckpointError(f"{source}: GGUF lacks tokenizer.ggml.tokens / "
                                      "tokenizer.ggml.scores")
            tokens = [("\u2581" * len(t)) if t and not t.strip(" ") else t for t in tokens]
            backend = _spm_backend(tokens, scores, types, fields, source)
            vocab = {t: i for i, t in enumerate(tokens)}
        elif not tokens or merges is None:
            raise CheckpointError(f"{source}: GGUF lacks tokenizer.ggml.tokens / tokenizer.ggml.merges")
        else:
            vocab = {t: i for i, t in enumerate(tokens)}
            pairs = [tuple(m.split(" ", 1)) for m in merges]
            backend = tokenizers.Tokenizer(models.BPE(vocab, pairs, fuse_unk=False,
                                                      byte_fallback=False))
            backend.pre_tokenizer = _gguf_pre_tokenizer(fields.get("tokenizer.ggml.pre", "default"),
                                                        source)
            backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t, ty in zip(tokens, types) if ty == TOKEN_TYPE_CONTROL])
        backend.add_tokens([AddedToken(t, special=False, normalized=False)
                            for t, ty in zip(tokens, types) if ty == TOKEN_TYPE_USER_DEFINED])

        def tok(key):
            i = fields.get(key)
            if i is None:
                return None
            if not 0 <= int(i) < len(tokens):
                raise CheckpointError(f"{source}: {key}={i} outside the vocabulary [0, {len(tokens)})")
            return tokens[int(i)]

        bos, eos = tok("tokenizer.ggml.bos_token_id"), tok("tokenizer.ggml.eos_token_id")
        if fields.get("tokenizer.ggml.add_bos_token") and bos is not None:
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
        template = fields.get("tokenizer.chat_template")
        if template is None and fields.get("general.architecture") == "gemma3":
            template = GEMMA_CHAT_TEMPLATE  # llama.cpp's built-in "gemma" template, as jinja
        return cls(backend, bos_token=bos, eos_token=eos, chat_template=template, source=source)

    def to_state(self) -> dict[str, Any]:
        """A JSON-serializable snapshot (used by the params cache); see `from_state`."""
        return {"tokenizer_json": self._tok.to_str(), "bos_token": self.bos_token,
                "eos_token": self.eos_token, "chat_template": self.chat_template, "source": self.source}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Tokenizer":
        """Rebuild a Tokenizer from `to_state()` output."""
        return cls(tokenizers.Tokenizer.from_str(state["tokenizer_json"]), bos_token=state["bos_token"],
                   eos_token=state["eos_token"], chat_template=state["chat_template"],
                   source=state["source"])

    # -- the interface ----------------------------------------------------------------------

    @property
    def backend_tokenizer(self) -> tokenizers.Tokenizer:
        """The wrapped `tokenizers.Tokenizer` (the name transformers' fast tokenizers use);
        the detokenizer streams through it (`tokenizers.decoders.DecodeStream`)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Text -> token ids. Special-token strings in `text` map to their ids.

        Raises: ValueError if `text` is not a str.
        """
        if not isinstance(text, str):
            raise ValueError(f"encode(text=...) needs a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Token ids -> text (invalid UTF-8 byte runs become U+FFFD).

        Raises: ValueError if an id lies outside [0, vocab_size).
        """
        ids = self._check_ids(ids)
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        """Token id(s) -> vocabulary string(s) (byte-level alphabet, e.g. 'Ġthe')."""
        if isinstance(ids, int):
            return self.convert_ids_to_tokens([ids])[0]
        return [self._tok.id_to_token(i) for i in self._check_ids(ids)]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = True, **kwargs: Any) -> list[int] | str:
        """Render `messages` with the chat template (transformers semantics).

        Args:
          messages: [{"role": str, "content": str}, ...].
          add_generation_prompt: append the assistant-turn header.
          tokenize: return ids (encoded without extra special tokens) instead of text.
          kwargs: extra template variables.
        Raises:
          ValueError: no chat template, malformed messages, or the template itself
            refusing them (its `raise_exception`, e.g. roles that do not alternate).
        """
        if self._template is None:
            raise ValueError(f"tokenizer from {self.source} has no chat template")
        if not isinstance(messages, (list, tuple)) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise ValueError("messages must be a list of {'role': str, 'content': str} dicts, "
                             f"got {messages!r:.200}")
        try:
            text = self._template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                tools=kwargs.pop("tools", None), documents=kwargs.pop("documents", None), **kwargs)
        except jinja2.exceptions.TemplateError as e:  # e.g. its raise_exception on roles
            raise ValueError(f"chat template of {self.source} rejected the messages: {e}") from e
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        out = [int(i) for i in ids]
        bad = [i for i in out if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} outside [0, vocab_size={self.vocab_size})")
        return out

    def __getstate__(self) -> dict:
        """Pickle support (the server's engine process sends its tokenizer to the API
        process): the compiled jinja template is dropped and rebuilt from its source."""
        state = dict(self.__dict__)
        state["_template"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.chat_template:
            self._template = _checked_template(self.chat_template, self.source)

    def __repr__(self) -> str:
        return (f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, "
                f"bos_token_id={self.bos_token_id}, eos_token_id={self.eos_token_id})")
