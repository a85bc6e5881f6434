"""IncrementalDetokenizer tests with a real byte-level BPE (HF `tokenizers`), trained here.

The tiny vocab (256 bytes + a few merges) guarantees that CJK characters and emoji are
split across tokens, so the U+FFFD hold-back is exercised on real byte-level decoding.
"""

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxserve.engine import detokenizer
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.sampling_params import SamplingParams

CORPUS = [
    "hello world. the quick brown fox jumps over the lazy dog.",
    "STOP here and never after; stop words stop nothing",
    "你好，世界！今天天气很好。我们去公园散步吧。",
    "emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧 here",
    "naïve café über straße — ☃ ∑ ∞",
]
END = "<|end|>"


class BpeTokenizer:
    """Thin wrapper giving the duck-typed interface the detokenizer relies on."""

    def __init__(self, backend: Tokenizer):
        self._tok = backend
        self.decoded_ids = 0  # total ids decoded, to check per-step cost

    def encode(self, text):
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens=True):
        self.decoded_ids += len(ids)
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids):
        return [self._tok.id_to_token(i) for i in ids]


class StreamBpeTokenizer(BpeTokenizer):
    """The same, exposing its Rust tokenizer: the detokenizer's DecodeStream fast path."""

    @property
    def backend_tokenizer(self):
        return self._tok


def _byte_level_bpe(corpus=CORPUS, vocab_size: int = 300, special=(END,)) -> Tokenizer:
    """A byte-level BPE (GPT-2's pre-tokenizer and decoder) trained on `corpus`."""
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(corpus, trainer=trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return t


@pytest.fixture(params=["window", "stream", "pieces"])
def tok(request, monkeypatch):
    """The same byte-level BPE through the window scheme, DecodeStream alone, and the piece
    table in front of DecodeStream (the default for a byte-level vocabulary)."""
    if request.param == "stream":
        monkeypatch.setattr(detokenizer, "_clean_pieces", lambda backend: None)
    t = _byte_level_bpe()
    return (BpeTokenizer if request.param == "window" else StreamBpeTokenizer)(t)


def _run(tok, ids, params=None, prompt=(), chunks=None, finish=True):
    """Feed ids (one per update, or in given chunk sizes); return (deltas, detok, updates)."""
    d = IncrementalDetokenizer(tok, list(prompt), params or SamplingParams())
    sizes = chunks or [1] * len(ids)
    deltas, updates, i = [], [], 0
    for k, n in enumerate(sizes):
        last = finish and k == len(sizes) - 1
        u = d.update(ids[i:i + n], finished=last)
        i += n
        deltas.append(u.delta_text)
        updates.append(u)
        if u.stop_string is not None:
            break
    return deltas, d, updates


TEXTS = CORPUS + ["混合 text 和 😀 emoji 在 一起 🎉!", "👨‍👩‍👧👨‍👩‍👧 ∞∞ 好好"]


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_matches_full_decode(tok, text):
    ids = tok.encode(text)
    deltas, d, _ = _run(tok, ids)
    assert "".join(deltas) == d.output_text == tok.decode(ids) == text
    assert not any("\ufffd" in x for x in deltas)


def test_multibyte_chars_really_split(tok):
    ids = tok.encode("你好😀👍🏽")
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the test above is meaningful


def _char_boundaries(tok, ids):
    """Token indices i where ids[:i] / ids[i:] do not split a character."""
    return [i for i in range(1, len(ids)) if "\ufffd" not in tok.decode(ids[i - 1:i + 1])
            and not tok.decode(ids[:i]).endswith("\ufffd")
            and not tok.decode(ids[i:]).startswith("\ufffd")]


@pytest.mark.parametrize("seed", range(6))
def test_random_chunking_and_prompt_context(tok, seed):
    rng = random.Random(seed)
    text = " ".join(rng.sample(TEXTS, 4))
    ids = tok.encode(text)
    cut = rng.choice(_char_boundaries(tok, ids))
    prompt, out = ids[:cut], ids[cut:]
    sizes = []
    while sum(sizes) < len(out):
        sizes.append(min(rng.randint(1, 5), len(out) - sum(sizes)))
    deltas, d, _ = _run(tok, out, prompt=prompt, chunks=sizes)
    assert "".join(deltas) == d.output_text == tok.decode(out)
    assert not any("\ufffd" in x for x in deltas)


def test_prompt_ending_mid_character(tok):
    ids = tok.encode("ab 你好 cd")
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    prompt, out = ids[:cut], ids[cut:]
    deltas, d, _ = _run(tok, out, prompt=prompt)
    # The split character is attributed to the prompt; no replacement char is streamed.
    assert "".join(deltas) == tok.decode(ids)[len(tok.decode(prompt)):]
    assert not any("\ufffd" in x for x in deltas)


def test_stop_string_spanning_tokens_excluded_and_included(tok):
    text = "hello world. STOP here and never after"
    ids = tok.encode(text)
    # The stop string is spread over several tokens.
    toks = [tok.decode([i]) for i in ids]
    assert not any("STOP" in t for t in toks)
    deltas, d, ups = _run(tok, ids, SamplingParams(stop=["STOP"]))
    assert d.output_text == "".join(deltas) == "hello world. "
    assert ups[-1].stop_string == "STOP" and ups[-1].finished and d.finished
    assert len(ups) < len(ids)  # finished as soon as the stop string completed

    deltas, d, ups = _run(tok, ids, SamplingParams(stop=["STOP"], include_stop_str_in_output=True))
    assert d.output_text == "".join(deltas) == "hello world. STOP"
    assert ups[-1].stop_string == "STOP"


def test_text_after_stop_in_same_chunk_never_emitted(tok):
    ids = tok.encode("abc STOP after text")
    deltas, d, ups = _run(tok, ids, SamplingParams(stop=["STOP", "after"]), chunks=[len(ids)],
                          finish=False)
    assert deltas == ["abc "] and ups[0].stop_string == "STOP"
    with pytest.raises(ValueError, match="after the request finished"):
        d.update(ids[:1], finished=False)
    assert d.update([], finished=True).delta_text == ""


def test_cjk_stop_string_and_earliest_match(tok):
    text = "你好，世界！今天天气很好。"
    ids = tok.encode(text)
    deltas, d, ups = _run(tok, ids, SamplingParams(stop=["天气", "世界"]))
    assert d.output_text == "".join(deltas) == "你好，"
    assert ups[-1].stop_string == "世界"
    assert not any("\ufffd" in x for x in deltas)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("chunked", [False, True])
def test_the_stop_string_that_ends_first_wins(tok, include, chunked):
    # Issue 30 item 1. Text "the quick brown fox", one update holding the whole text (or
    # one token per update): stops ["quick brown", "ick b", "quick"] end (exclusive) at
    # 15, 11 and 9, so "quick" wins although "quick brown" is listed first and starts at
    # the same place; "uick b" and "ick b" both end at 11: the tie goes to the earlier
    # in the list.
    text = "the quick brown fox"
    ids = tok.encode(text)
    chunks = [len(ids)] if chunked else None
    for stops, want, cut in ((["quick brown", "ick b", "quick"], "quick", 9),
                             (["uick b", "ick b"], "uick b", 11),
                             (["ick b", "uick b"], "ick b", 11)):
        p = SamplingParams(stop=stops, include_stop_str_in_output=include)
        deltas, d, ups = _run(tok, ids, p, chunks=chunks, finish=False)
        assert ups[-1].stop_string == want, (stops, ups[-1].stop_string)
        start = cut - len(want)
        assert d.output_text == "".join(deltas) == text[:cut if include else start]


def test_holdback_of_possible_stop_prefix_and_flush_on_finish(tok):
    ids = tok.encode("the lazy dog sto")
    params = SamplingParams(stop=["stop words"])
    deltas, d, _ = _run(tok, ids, params, finish=False)
    # "sto" could start the stop string: held back while running ...
    assert d.output_text == "".join(deltas) == "the lazy dog "
    # ... and flushed when the request ends for another reason (EOS, max_tokens).
    u = d.update([], finished=True)
    assert u.delta_text == "sto" and u.stop_string is None and u.finished
    assert d.output_text == "the lazy dog sto"


def test_held_back_prefix_released_when_it_diverges(tok):
    ids = tok.encode("the stop nothing")
    deltas, d, ups = _run(tok, ids, SamplingParams(stop=["stop words"]), finish=False)
    assert ups[-1].stop_string is None
    assert "".join(deltas) == d.output_text == "the stop nothing"


def test_special_tokens_skipped_or_kept(tok):
    end = tok._tok.token_to_id(END)
    ids = tok.encode("hello") + [end] + tok.encode(" world")
    deltas, d, _ = _run(tok, ids)
    assert "".join(deltas) == "hello world"
    deltas, d, _ = _run(tok, ids, SamplingParams(skip_special_tokens=False))
    assert "".join(deltas) == d.output_text == tok.decode(ids, skip_special_tokens=False)
    assert END in d.output_text


def test_incomplete_char_at_finish_and_invalid_bytes(tok):
    ids = tok.encode("ab😀")
    # Finish in the middle of the emoji: the flush matches what decode() gives.
    part = ids[:-1]
    deltas, d, _ = _run(tok, part)
    assert "".join(deltas) == tok.decode(part) and d.output_text.endswith("\ufffd")
    # A genuinely invalid byte followed by text: emitted eventually, window stays bounded.
    lone = tok.encode("😀")[-1]  # a continuation byte on its own
    ids = tok.encode("x") + [lone] + tok.encode(" hello world the quick brown fox")
    deltas, d, _ = _run(tok, ids, finish=False)
    assert "".join(deltas).startswith("x\ufffd hello")
    d.update([], finished=True)
    assert d.output_text == tok.decode(ids)


def test_cost_per_step_is_bounded(tok):
    ids = tok.encode(" ".join(TEXTS)) * 40  # a few thousand tokens
    tok.decoded_ids = 0
    deltas, d, _ = _run(tok, ids)
    assert "".join(deltas) == tok.decode(ids)
    tok.decoded_ids = 0
    _, d, _ = _run(tok, ids, finish=False)
    assert tok.decoded_ids <= 30 * len(ids)  # O(n), not O(n^2)
    if isinstance(tok, StreamBpeTokenizer):  # every id went through the DecodeStream
        assert d._stream is not None and tok.decoded_ids == 0


GGUF = Path(__file__).resolve().parents[2] / "checkpoints" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.skipif(not GGUF.is_file(), reason="SmolLM2 GGUF not downloaded")
@pytest.mark.slow
def test_real_smollm2_tokenizer():
    from jaxserve.checkpoint.gguf_loader import read_gguf_header

    _, _, real = read_gguf_header(GGUF)
    text = "Hello 世界! 😀👍🏽 naïve café — 今天天气很好。 The end."
    ids = real.encode(text)
    deltas, d, _ = _run(real, ids)
    assert "".join(deltas) == d.output_text == real.decode(ids) == text
    assert not any("\ufffd" in x for x in deltas)
    deltas, d, ups = _run(real, ids, SamplingParams(stop=["天气"]))
    assert d.output_text == "Hello 世界! 😀👍🏽 naïve café — 今天" and ups[-1].stop_string == "天气"


class _FailingStream:
    """A DecodeStream that raises on its n-th step, as tokenizers does with "Invalid prefix
    encountered" on non-monotonic byte-fallback decodes (vLLM #17448)."""

    def __init__(self, real, n):
        self.real, self.n = real, n

    def step(self, backend, t):
        self.n -= 1
        if self.n < 0:
            raise Exception("Invalid prefix encountered")
        return self.real.step(backend, t)


@pytest.mark.parametrize("fail_at", [0, 3, 9])
@pytest.mark.parametrize("one", [True, False])
def test_a_failing_decode_stream_hands_over_to_the_window_scheme(tok, fail_at, one):
    text = TEXTS[-2]
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, [], SamplingParams())
    if d._stream is None:
        pytest.skip("the window tokenizer has no DecodeStream")
    d._pieces = None  # every token through the stream (a remade stream would not fail)
    d._stream = _FailingStream(d._stream, fail_at)
    if one:  # the engine's fast path, then the finish
        out = "".join(d.update_one(t) for t in ids) + d.update([], finished=True).delta_text
    else:
        out = "".join(d.update([t], finished=False).delta_text for t in ids)
        out += d.update([], finished=True).delta_text
    assert out == d.output_text == text and d._stream is None and "\ufffd" not in out


class _CleanUpTokenizer(StreamBpeTokenizer):
    """An HF tokenizer with `clean_up_tokenization_spaces=True`: its decode drops the space
    before punctuation unless told not to (HF's `clean_up_tokenization_spaces=False`)."""

    clean_up_tokenization_spaces = True

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=None):
        text = super().decode(ids, skip_special_tokens)
        if clean_up_tokenization_spaces is not False:
            for a, b in ((" .", "."), (" ,", ","), (" !", "!"), (" ?", "?")):
                text = text.replace(a, b)
        return text


def test_a_tokenizer_that_cleans_up_spaces_loses_no_text(tok):
    """The clean-up cannot stream (the space goes out before the "." arrives), so neither
    scheme applies it, as in vLLM; the window scheme used to drop the punctuation."""
    text = "hello world . the quick , brown fox ! and the lazy dog ?"
    t = _CleanUpTokenizer(tok._tok)
    ids = t.encode(text)
    assert t.decode(ids) != text  # the tokenizer does clean up by default
    for one in (True, False):
        d = IncrementalDetokenizer(t, [], SamplingParams())
        if type(tok) is BpeTokenizer:
            d._stream = None  # the window scheme
        feed = (lambda i: d.update_one(i) if one and d.plain
                else d.update([i], finished=False).delta_text)
        out = "".join(feed(i) for i in ids) + d.update([], finished=True).delta_text
        assert out == d.output_text == text


def _pieces_against_stream(tok, seed: int, vocab: int, pool: list[int]) -> None:
    """Random ids (any id, ids of split characters, special ids, ids of real text) fed
    one at a time to a detokenizer with the piece table and one without: the same delta
    at every token and the same final text."""
    rng = random.Random(seed)
    ids = [rng.choice([rng.randrange(vocab), rng.choice(pool)]) for _ in range(rng.randint(1, 40))]
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
    a = IncrementalDetokenizer(tok, prompt, SamplingParams())
    b = IncrementalDetokenizer(tok, prompt, SamplingParams())
    b._pieces = None
    if a._stream is None:  # a prompt ending mid-character: the window scheme for both
        return
    assert a._pieces is not None
    out = [[], []]
    for t in ids:
        for d, o in zip((a, b), out):
            o.append(d.update_one(t) if d.plain else d.update([t], finished=False).delta_text)
    for d, o in zip((a, b), out):
        o.append(d.update([], finished=True).delta_text)
    assert out[0] == out[1], (seed, ids, prompt)
    assert a.output_text == b.output_text


@pytest.mark.parametrize("seed", range(40))
def test_piece_table_equals_the_stream(seed):
    t = _byte_level_bpe()
    tok = StreamBpeTokenizer(t)
    vocab = t.get_vocab_size(with_added_tokens=True)
    table = detokenizer._clean_pieces(t)
    assert table[t.token_to_id(END)] is None  # special: skipped, so never a piece
    assert any(p is None for p in table[:vocab - 1])  # split characters are not pieces
    pool = [i for x in TEXTS for i in tok.encode(x)] + [i for i in range(vocab) if table[i] is None]
    for k in range(10):
        _pieces_against_stream(tok, seed * 10 + k, vocab, pool)


@pytest.mark.skipif(not GGUF.is_file(), reason="SmolLM2 GGUF not downloaded")
def test_piece_table_equals_the_stream_smollm2():
    from jaxserve.checkpoint.gguf_loader import read_gguf_header

    _, _, real = read_gguf_header(GGUF)
    be = real.backend_tokenizer
    vocab = be.get_vocab_size(with_added_tokens=True)
    table = detokenizer._clean_pieces(be)
    assert table[real.encode(" Hello")[0]] == " Hello"
    pool = [i for x in TEXTS for i in real.encode(x)] + [i for i in range(vocab) if table[i] is None]
    for seed in range(300):
        _pieces_against_stream(real, seed, vocab, pool)


def test_no_piece_table_for_a_sentencepiece_decoder():
    t = Tokenizer(models.BPE())
    t.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Strip(" ", 1, 0)])
    assert detokenizer._clean_pieces(t) is None


def test_the_output_processor_makes_the_piece_table_at_start():
    """Built with the engine, so no request pays for it in its time to first token."""
    from jaxserve.engine.output_processor import OutputProcessor

    t = _byte_level_bpe(CORPUS[:2], 280, special=())
    assert id(t) not in detokenizer._PIECES
    OutputProcessor(StreamBpeTokenizer(t))
    assert detokenizer._PIECES[id(t)][0] is t and detokenizer._PIECES[id(t)][2] is not None


def test_the_piece_table_follows_a_grown_vocabulary():
    t = _byte_level_bpe(CORPUS[:2], 280, special=())
    tok = StreamBpeTokenizer(t)
    n = len(detokenizer._clean_pieces(t))
    t.add_tokens(["<newtok>"])
    d = IncrementalDetokenizer(tok, [], SamplingParams())
    assert len(d._pieces) == n + 1
    assert d.update_one(t.token_to_id("<newtok>")) == t.decode([t.token_to_id("<newtok>")])
