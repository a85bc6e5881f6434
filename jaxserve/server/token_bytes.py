"""Each token's real UTF-8 bytes for chat `logprobs` (OpenAI's `bytes` field).

Byte-level BPE (GPT-2, SmolLM2, Llama 3) splits a multi-byte character (CJK, emoji)
over several tokens; decoding one such token alone yields U+FFFD, whose UTF-8 is
`[239, 191, 189]` -- the bytes the client needs are lost. Here a token's bytes come
from its vocabulary string through the inverse of GPT-2's `bytes_to_unicode` table
(what `tokenizers.decoders.ByteLevel` does), so the `bytes` lists of a choice join
back to exactly the UTF-8 of its content.

The `token` string follows vLLM's V1 logprobs processor (`_correct_decoded_token`):
a token that leaves a character unfinished reports `""`, and the token that finishes
it reports the whole character (the earlier pieces' bytes included). Top-logprob
alternatives are read against the same sampled history.
"""

from __future__ import annotations

import codecs
import functools
from typing import Any

_REPLACEMENT = "\ufffd"


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character -> the byte it stands for (256 entries)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The raw bytes token `token_id` stands for.

    A token that decodes alone to clean text gives that text's UTF-8. One whose decode
    holds U+FFFD (a piece of a character) is read from its byte-level vocabulary string
    (`convert_ids_to_tokens`); characters outside the byte alphabet (an added token's)
    count as their own UTF-8.
    """
    s = tokenizer.decode([token_id], skip_special_tokens=False)
    if _REPLACEMENT not in s or not hasattr(tokenizer, "convert_ids_to_tokens"):
        return s.encode()
    piece = tokenizer.convert_ids_to_tokens(token_id)
    table = _byte_decoder()
    return b"".join(bytes([table[c]]) if c in table else c.encode() for c in piece)


def _complete_prefix(data: bytes) -> tuple[str, bytes]:
    """(text of `data`'s complete characters, its unfinished trailing character's bytes).

    Invalid bytes before the end read as U+FFFD, as in `bytes.decode(errors="replace")`.
    """
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text = dec.decode(data, final=False)
    return text, dec.getstate()[0]


class ChatLogprobTokens:
    """One choice's token -> (`token`, `bytes`) reader; keeps the unfinished character
    across calls, so a streamed choice reads the same as the whole one.

    Args:
      tokenizer: `decode(ids, skip_special_tokens=)` and, for byte-level BPE,
        `convert_ids_to_tokens(id)`.
    """

    def __init__(self, tokenizer: Any):
        self._tok = tokenizer
        self._pending = b""  # bytes of the sampled tokens' unfinished character

    def entry(self, token_id: int) -> tuple[str, list[int]]:
        """`token` string and `bytes` of alternative `token_id` at the next position."""
        raw = token_bytes(self._tok, token_id)
        text, _ = _complete_prefix(self._pending + raw)
        return text, list(raw)

    def advance(self, token_id: int) -> None:
        """The sampled `token_id` joins the history."""
        _, self._pending = _complete_prefix(self._pending + token_bytes(self._tok, token_id))
