"""Tokenizer from the SmolLM2 GGUF vs the HF transformers golden ids; interface errors."""

from __future__ import annotations

import json

import pytest

from jaxserve.checkpoint import load_tokenizer
from jaxserve.checkpoint.tokenizer import Tokenizer

from .conftest import FIXTURES

GOLDEN = json.loads((FIXTURES / "smollm2" / "tokenizer_golden.json").read_text())


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    # cache_dir=None: exercise the GGUF-metadata path, not a cached snapshot.
    return load_tokenizer(cache_dir=None)  # FileNotFoundError names `make model` if absent


def test_special_ids(tok):
    assert (tok.bos_token_id, tok.eos_token_id) == (GOLDEN["bos_token_id"], GOLDEN["eos_token_id"])
    assert tok.vocab_size == GOLDEN["vocab_size"] == 49152
    assert tok.all_special_ids == list(range(17))
    assert tok.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]


@pytest.mark.parametrize("case", GOLDEN["plain"], ids=lambda c: repr(c["text"][:24]))
def test_plain_ids_match_hf(tok, case):
    ids = tok.encode(case["text"])
    assert ids == case["ids"]
    assert tok.decode(ids, skip_special_tokens=False) == case["text"]


def test_digits_are_split_individually(tok):
    # SmolLM2's pre-tokenizer isolates every digit (tokenizer.ggml.pre = "smollm").
    assert tok.convert_ids_to_tokens(tok.encode("x 2024")) == ["x", "Ġ", "2", "0", "2", "4"]


@pytest.mark.parametrize("case", GOLDEN["chat"], ids=lambda c: c["messages"][-1]["content"][:20])
def test_chat_template_matches_hf(tok, case):
    assert tok.apply_chat_template(case["messages"], tokenize=False) == case["text"]
    assert tok.apply_chat_template(case["messages"]) == case["ids"]


def test_pickled_copy_matches_the_hf_golden(tok):
    """The engine process sends its tokenizer to the API process (`--engine_process`)."""
    import pickle

    copy = pickle.loads(pickle.dumps(tok))
    for case in GOLDEN["plain"][:4]:
        assert copy.encode(case["text"]) == case["ids"]
    for case in GOLDEN["chat"][:2]:
        assert copy.apply_chat_template(case["messages"], tokenize=False) == case["text"]
    assert (copy.eos_token_id, copy.vocab_size) == (tok.eos_token_id, tok.vocab_size)


def test_decode_skips_special_tokens(tok):
    ids = tok.apply_chat_template([{"role": "user", "content": "héllo 😀"}])
    text = tok.decode(ids)
    assert "<|im_start|>" not in text and "héllo 😀" in text
    no_prompt = tok.apply_chat_template([{"role": "user", "content": "a"}], add_generation_prompt=False,
                                        tokenize=False)
    assert not no_prompt.endswith("<|im_start|>assistant\n")


def test_bad_inputs_raise_clear_errors(tok):
    with pytest.raises(ValueError, match=r"outside \[0, vocab_size=49152\)"):
        tok.decode([5, 49152])
    with pytest.raises(ValueError, match="needs a str"):
        tok.encode(["not", "a", "string"])
    with pytest.raises(ValueError, match="messages must be a list"):
        tok.apply_chat_template([{"content": "no role"}])


def test_no_chat_template_raises():
    import tokenizers
    from tokenizers import models
    t = Tokenizer(tokenizers.Tokenizer(models.BPE({"a": 0}, [])), bos_token=None, eos_token=None,
                  chat_template=None)
    with pytest.raises(ValueError, match="has no chat template"):
        t.apply_chat_template([{"role": "user", "content": "a"}])
