"""Incremental, UTF-8-safe detokenization with stop strings (one request, host side).

The token-offset scheme is vLLM's (`detokenize_incrementally`, after HF TGI): keep
two offsets into prompt+output ids, `prefix_offset <= read_offset`; each step decodes
only the short window `ids[prefix_offset:]` and the prefix `ids[prefix_offset:
read_offset]`, and the new text is the difference. Decoding with context from the
previous few tokens keeps tokenizer-specific joins (leading spaces, byte-level
merges) correct, and the per-step cost is O(window), not O(output length).

Byte-level BPE splits multi-byte characters (CJK, emoji) across tokens; a window whose
decode ends in U+FFFD holds back until the character completes, so no delta ever
carries a replacement character for a split character. Stop strings are searched in
the stable text (they may span tokens); text after a stop string is never emitted,
and while a request runs, a tail that is a proper prefix of some stop string is held
back (unless `include_stop_str_in_output`, where nothing after a match can have
been emitted early). Held-back text is flushed when the request finishes for
another reason (EOS, max_tokens, abort).

Fast path (issue 24): a tokenizer that exposes its Rust `tokenizers.Tokenizer`
(`backend_tokenizer`, as ours and transformers' fast tokenizers do) is streamed through
`tokenizers.decoders.DecodeStream`, the same offset scheme in one Rust call per token
(~1 us against ~20 us for two window decodes in Python). Where the two could differ, the
request goes back to the window scheme for good: a prompt whose context ends mid-character
(DecodeStream would re-emit the context) and more than `_MAX_PENDING` tokens with no text
(a genuinely invalid byte run: the window scheme emits U+FFFD, DecodeStream waits).

Faster still for a byte-level BPE vocabulary (GPT-2's decoder: SmolLM2, Llama 3, Qwen 2):
its decode is the UTF-8 decoding of the concatenated bytes of each token, so a token whose
own bytes are complete UTF-8, arriving when no character is pending, adds exactly its own
decode, looked up in a table made once per tokenizer (`_clean_pieces`; llama.cpp's
token-to-piece). Any other token goes through a DecodeStream remade from the window's
context (`_resync`). ~0.05 us a token against ~1.2 for the stream's Rust call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

from tokenizers.decoders import ByteLevel, DecodeStream

from jaxserve.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"
# Context tokens decoded before the first output token (vLLM uses 5).
_INITIAL_CONTEXT = 5
# A split UTF-8 character spans at most 3 trailing bytes, hence at most 3 tokens; a
# window that still ends in U+FFFD past this many pending tokens holds a genuinely
# invalid byte sequence, which is emitted (as U+FFFD) so the window stays bounded.
_MAX_PENDING = 4


# id(backend) -> (backend, its vocabulary size then, table): the clean pieces of the last
# few Rust tokenizers seen (one a process in practice: the model's)
_PIECES: dict[int, tuple[object, int, list[str | None] | None]] = {}
_MAX_TABLES = 4


def _clean_pieces(backend) -> list[str | None] | None:
    """For a `tokenizers.Tokenizer` whose decoder is byte-level (`decoders.ByteLevel`): each
    id's decode with special tokens skipped, or None where that is not a whole piece of text
    (empty: a special token; U+FFFD: part of a character). None for any other decoder (its
    decode is not a concatenation: SentencePiece's leading-space rules, say). Made once per
    tokenizer (~65 ms for 49k ids) and kept, made again if its vocabulary grew
    (`add_tokens`). A token made special after that keeps its old piece: the table assumes
    a tokenizer is not changed once requests run on it."""
    n = backend.get_vocab_size(with_added_tokens=True)
    hit = _PIECES.get(id(backend))
    if hit is not None and hit[0] is backend and hit[1] == n:
        return hit[2]
    table = None
    if isinstance(backend.decoder, ByteLevel):
        table = [p if p and _REPLACEMENT not in p else None
                 for p in backend.decode_batch([[i] for i in range(n)], skip_special_tokens=True)]
    _PIECES.pop(id(backend), None)
    while len(_PIECES) >= _MAX_TABLES:  # the oldest goes (tests build many tokenizers)
        del _PIECES[next(iter(_PIECES))]
    _PIECES[id(backend)] = (backend, n, table)
    return table


def prepare_pieces(tokenizer: object) -> None:
    """Make `tokenizer`'s piece table now (`_clean_pieces`; ~65 ms for 49k ids) if it has
    a Rust tokenizer, so the first request does not pay for it in its time to first token
    (the engine's output processor calls it at start-up)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        _clean_pieces(backend)


class TokenizerLike(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def convert_ids_to_tokens(self, ids): ...


class DetokenizerUpdate(NamedTuple):
    """Result of one `IncrementalDetokenizer.update` call (a NamedTuple: one is made per
    row per step, and a tuple is several times cheaper to build than a frozen dataclass).

    delta_text: new text to stream (possibly empty).
    stop_string: the stop string that matched in this update; the request must finish
      now and its text ends at (or, with include_stop_str_in_output, after) it.
    finished: True once the text is final (stop string matched or finished=True given).
    """

    delta_text: str
    stop_string: str | None = None
    finished: bool = False


class IncrementalDetokenizer:
    """Turns a stream of sampled token ids into streamed text for one request (one sample).

    Args:
      tokenizer: duck-typed; `decode(ids, skip_special_tokens=...)` is all that is used.
      prompt_token_ids: the prompt, used as left context for the first output tokens.
      params: SamplingParams (stop, include_stop_str_in_output, skip_special_tokens).
    """

    def __init__(self, tokenizer: TokenizerLike, prompt_token_ids: Sequence[int],
                 params: SamplingParams):
        self._tok = tokenizer
        self._skip = params.skip_special_tokens
        self._stops = tuple(params.stop)
        self._include_stop = params.include_stop_str_in_output
        self._ids: list[int] = list(prompt_token_ids)
        self._num_prompt = len(self._ids)
        self._prefix_offset = max(self._num_prompt - _INITIAL_CONTEXT, 0)
        self._read_offset = self._num_prompt
        self._text = ""  # stable decoded output text (complete characters only)
        self._emitted = 0  # chars of _text already returned as deltas
        self._finished = False
        self._stop_string: str | None = None
        # An HF tokenizer's `clean_up_tokenization_spaces` (" ." -> ".") is not applied: the
        # space may have been streamed before the "." arrives (vLLM's detokenizers skip it too).
        self._clean_up = getattr(tokenizer, "clean_up_tokenization_spaces", False) is True
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream: DecodeStream | None = None
        self._pieces: list[str | None] | None = None  # `_clean_pieces`, in stream mode
        self._stale = False  # tokens were looked up since the stream's last step
        if self._backend is not None:
            self._vocab = self._backend.get_vocab_size(with_added_tokens=True)
            context = self._ids[self._prefix_offset:]
            if not self._decode(self._prefix_offset, self._read_offset).endswith(_REPLACEMENT):
                self._stream = DecodeStream(ids=context, skip_special_tokens=self._skip)
                if self._skip:
                    self._pieces = _clean_pieces(self._backend)

    @property
    def output_text(self) -> str:
        """Text streamed so far; after finishing, the final output text."""
        return self._text[:self._emitted]

    @property
    def text(self) -> str:
        """The stable text decoded so far, held-back tail included (`output_text` is its
        first `num_emitted` characters); a str, so a reference to it is a snapshot."""
        return self._text

    @property
    def num_emitted(self) -> int:
        """Characters of `text` streamed so far."""
        return self._emitted

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def num_output_tokens(self) -> int:
        return len(self._ids) - self._num_prompt

    def _decode(self, start: int, end: int) -> str:
        if self._clean_up:  # HF's clean-up drops a space already streamed: never here
            return self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip,
                                    clean_up_tokenization_spaces=False)
        return self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def _advance(self, force: bool) -> str:
        """Decode pending ids; return newly stable text and move the offsets."""
        n = len(self._ids)
        if n == self._read_offset:
            return ""
        prefix = self._decode(self._prefix_offset, self._read_offset)
        end = n
        full = self._decode(self._prefix_offset, end)
        if not force and full.endswith(_REPLACEMENT):
            # The incomplete character's bytes lie in the last <= 3 tokens: emit up to
            # the latest earlier cut that decodes cleanly (several ids may arrive at once).
            for end in range(n - 1, max(self._read_offset, n - _MAX_PENDING), -1):
                full = self._decode(self._prefix_offset, end)
                if not full.endswith(_REPLACEMENT):
                    break
            else:
                if n - self._read_offset <= _MAX_PENDING:
                    return ""  # wait for the rest of the character
                end = n - (_MAX_PENDING - 1)  # genuinely invalid bytes: emit them
                full = self._decode(self._prefix_offset, end)
        if len(full) <= len(prefix) and not force:
            return ""  # e.g. a special token skipped in decoding
        self._prefix_offset, self._read_offset = self._read_offset, end
        return full[len(prefix):]

    @property
    def plain(self) -> bool:
        """True while `update_one` applies: streaming, no stop strings, not finished."""
        return self._stream is not None and not self._stops and not self._finished

    def update_one(self, t: int) -> str:
        """`update([t], finished=False).delta_text` when `plain` (the caller checks): one
        token through the DecodeStream, no stop strings to search or hold back for.

        Raises:
          ValueError: t outside the tokenizer's vocabulary.
        """
        t = int(t)
        if not 0 <= t < self._vocab:
            raise ValueError(f"token id {t} outside [0, vocab_size={self._vocab})")
        ids = self._ids
        if self._pieces is not None and self._read_offset == len(ids) \
                and (chunk := self._pieces[t]) is not None:  # a whole piece, nothing pending
            ids.append(t)
            self._prefix_offset, self._read_offset = self._read_offset, len(ids)
            self._stale = True
        else:
            ids.append(t)
            chunk = self._stream_step(t)
            if chunk is None:
                if self._stream is not None and len(ids) - self._read_offset <= _MAX_PENDING:
                    return ""
                self._stream = None
                chunk = self._advance(force=False)
            else:
                self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        self._text += chunk
        self._emitted = len(self._text)
        return chunk

    def _stream_step(self, t: int) -> str | None:
        """DecodeStream's chunk for id t (None: no text yet). If the stream raises (tokenizers'
        "Invalid prefix" on a byte-fallback vocabulary whose decodes are not monotonic, vLLM
        #17448; or a Rust panic, a BaseException) it is dropped: `_stream` becomes None and
        the caller goes on with the window scheme from the ids already appended. A stream
        that missed tokens looked up in the piece table is remade first (`_resync`)."""
        if self._stale:  # the stream missed the tokens looked up: remade from the window
            self._resync()
        try:
            return self._stream.step(self._backend, t)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # noqa: BLE001 - pyo3's PanicException is a BaseException
            self._stream = None
            return None

    def _resync(self) -> None:
        """A DecodeStream whose context is the window's prefix `ids[prefix_offset:
        read_offset]` (before the id just appended), as the stream would hold had it seen
        every token."""
        self._stream = DecodeStream(ids=self._ids[self._prefix_offset:self._read_offset],
                                    skip_special_tokens=self._skip)
        self._stale = False

    def _step_stream(self, new_token_ids: Sequence[int]) -> str:
        """Feed ids to the DecodeStream, keeping the window offsets as `_advance` would set
        them; hands the request to the window scheme if the stream waits too long."""
        text = ""
        for k, t in enumerate(new_token_ids):
            t = int(t)
            if not 0 <= t < self._vocab:
                raise ValueError(f"token id {t} outside [0, vocab_size={self._vocab})")
            self._ids.append(t)
            chunk = self._stream_step(t)
            if chunk is not None:
                text += chunk
                self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            elif self._stream is None or len(self._ids) - self._read_offset > _MAX_PENDING:
                self._stream = None  # an invalid byte run: the window scheme from here on
                self._ids.extend(int(i) for i in new_token_ids[k + 1:])
                return text + self._advance(force=False)
        return text

    def _find_stop(self, start: int) -> tuple[int, str] | None:
        """(start index, stop string) of the match beginning at or after `start` that
        ENDS first, ties to the earlier string in `stop`: what a decoder fed one
        character at a time would stop at (vLLM's rule, its PRs #49391 / #50200)."""
        best: tuple[int, str] | None = None
        for s in self._stops:
            i = self._text.find(s, start)
            if i >= 0 and (best is None or i + len(s) < best[0] + len(best[1])):
                best = (i, s)
        return best

    def _holdback(self) -> int:
        """Length of the longest tail of _text that is a proper prefix of a stop string."""
        if self._include_stop or not self._stops:
            return 0
        longest = max(len(s) for s in self._stops) - 1
        for n in range(min(longest, len(self._text) - self._emitted), 0, -1):
            tail = self._text[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0

    def update(self, new_token_ids: Sequence[int], *, finished: bool,
               stop_terminated: bool = False) -> DetokenizerUpdate:
        """Append sampled ids; return the text that may be streamed now.

        Args:
          new_token_ids: ids sampled since the last call (may be empty).
          finished: the request ends after these ids for a reason other than a stop
            string (EOS, stop token, max_tokens, abort): flush all held-back text.
          stop_terminated: the last of `new_token_ids` is the token that stopped the
            request (EOS or a stop token id). Its text is left out of the output
            unless `include_stop_str_in_output` (vLLM's detokenizer does the same);
            the caller keeps the id in `token_ids`. Implies `finished`.

        Returns:
          DetokenizerUpdate. If `stop_string` is set the caller must finish the request.

        Raises:
          ValueError: new ids arrive after the text was finalised.
        """
        if self._finished:
            if new_token_ids:
                raise ValueError(
                    f"update() got {len(new_token_ids)} ids after the request finished "
                    f"(stop_string={self._stop_string!r})")
            return DetokenizerUpdate("", None, True)
        if stop_terminated:
            finished = True
            if not self._include_stop and new_token_ids:
                new_token_ids = new_token_ids[:-1]
        old_len = len(self._text)
        if self._stream is not None:
            if not finished and not self._stops and len(new_token_ids) == 1:
                return DetokenizerUpdate(self.update_one(new_token_ids[0]))
            self._text += self._step_stream(new_token_ids)
            if finished:  # emit what the stream still holds (an incomplete character)
                self._text += self._advance(force=True)
        else:
            self._ids.extend(int(t) for t in new_token_ids)
            self._text += self._advance(force=finished)
        if self._stops:
            # A new match ends in the new text, so it starts at most longest-1 chars
            # earlier. Without include_stop_str_in_output, the hold-back guarantees that
            # such a start was never emitted.
            longest = max(len(s) for s in self._stops)
            match = self._find_stop(max(old_len - longest + 1, 0))
            if match is not None:
                i, s = match
                self._text = self._text[:i + len(s) if self._include_stop else i]
                self._finished, self._stop_string = True, s
                return self._emit(stop_string=s)
        if finished:
            self._finished = True
            return self._emit()
        return self._emit(hold=self._holdback())

    def _emit(self, *, hold: int = 0, stop_string: str | None = None) -> DetokenizerUpdate:
        end = max(len(self._text) - hold, self._emitted)
        delta = self._text[self._emitted:end]
        self._emitted = end
        return DetokenizerUpdate(delta, stop_string, self._finished)
