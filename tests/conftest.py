"""Shared test fixtures: a tiny char-level tokenizer and cached tiny engines.

Tiny configs use mutually distinct sizes (vocab 67, hidden 48, 6 heads over
2 KV heads, head_dim 8) so a transposed axis fails loudly. Engines are cached
per configuration so each static configuration compiles once per session.
"""

from __future__ import annotations

import functools
import string

import numpy as np
import pytest

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ bos_token }}{{ m['role'] }} {{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant {% endif %}")


def char_tokenizer(chars, *, unk: str | None):
    """A character-level tokenizer wrapped in jaxserve's Tokenizer: ids 0 <pad>, 1 <s>,
    2 </s> (EOS), then one id per character of `chars` in order, then `unk` if given
    (the unknown token; None: unknown characters map to <pad>)."""
    import tokenizers
    from tokenizers import Regex, decoders, models, pre_tokenizers

    from jaxserve.checkpoint.tokenizer import Tokenizer

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for c in chars:
        vocab[c] = len(vocab)
    if unk is not None:
        vocab[unk] = len(vocab)
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=unk or "<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(["<pad>", "<s>", "</s>"])
    return Tokenizer(backend, bos_token="<s>", eos_token="</s>", chat_template=TINY_CHAT_TEMPLATE)


@functools.lru_cache(maxsize=None)
def tiny_tokenizer():
    """A 67-token character-level tokenizer wrapped in jaxserve's Tokenizer.

    ids: 0 <pad>, 1 <s>, 2 </s>, 3 ' ', 4..65 ASCII letters and digits, 66 <unk>.
    """
    chars = [" "] + list(string.ascii_lowercase) + list(string.ascii_uppercase) + list("0123456789")
    assert len(chars) == 63, len(chars)
    tok = char_tokenizer(chars, unk="<unk>")
    assert tok.vocab_size == 67, tok.vocab_size
    return tok


@functools.lru_cache(maxsize=None)
def tiny_params(seed: int = 0, init_std: float = 0.3, **cfg_kw):
    """Random tiny-model parameters (numpy). A wide init keeps greedy margins far from ties."""
    import jax
    from flax import nnx

    from jaxserve.config import ModelConfig
    from jaxserve.model.llama import Llama, canonical_params

    cfg = ModelConfig.tiny(**dict(cfg_kw))
    model = Llama(cfg, rngs=nnx.Rngs(seed), init_std=init_std)
    return cfg, jax.tree.map(np.asarray, canonical_params(model))


_ENGINES: dict = {}


def tiny_engine(**engine_args):
    """A warmed-up LLMEngine over the tiny model, cached per argument set.

    Cached engines are shared between tests: a test must leave it idle (all
    requests finished or aborted), which the engine tests assert anyway.
    """
    from jaxserve.engine import LLMEngine, make_engine_config

    key = tuple(sorted(engine_args.items()))
    if key not in _ENGINES:
        cfg, params = tiny_params()
        # Buckets from 8 (not the default 1): fewer programs per engine keeps the suite
        # fast; test_c24 runs the default's 1-, 2- and 4-token / row buckets.
        args = dict(max_model_len=256, block_size=4, num_kv_blocks=256, max_num_seqs=8,
                    max_num_batched_tokens=64, attention_backend="xla", min_token_bucket=8,
                    min_seq_bucket=8,
                    strict_compiles=True)  # a step without a warm-up program is a bug: refuse
        args.update(engine_args)
        config = make_engine_config(cfg, **args)
        _ENGINES[key] = LLMEngine(config, params, tiny_tokenizer(), model_name="tiny",
                                  progress=False)
    engine = _ENGINES[key]
    assert not engine.has_unfinished_requests(), "a previous test left requests in the engine"
    return engine


def drain(eng, outs=None) -> dict:
    """Step `eng` until idle; request_id -> its last RequestOutput (added to `outs`)."""
    outs = {} if outs is None else outs
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
    return outs


@pytest.fixture
def tokenizer():
    return tiny_tokenizer()
