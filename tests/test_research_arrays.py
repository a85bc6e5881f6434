"""Array prompts and padded rollout arrays of `LLM.generate` (issue 15), over the real
`LLMEngine` with the FakeRunner: exact scripted tokens, milliseconds per test.

Script (`eos_after`): a request whose first prompt token is k samples k ordinary
tokens 10, 11, ... then EOS (id 2); sample j of a request adds j ordinary tokens.
Token t at output position p has logprob -(p + 1) / 8 - j, exact in fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_tokenizer
from jaxserve import LLM
from jaxserve.config import ModelConfig
from jaxserve.engine import LLMEngine, make_engine_config
from jaxserve.outputs import rollout_arrays
from jaxserve.worker.runner import SampledToken
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.fake_runner import FakeRunner, counting_token

EOS = 2
ARGS = dict(max_model_len=64, block_size=4, num_kv_blocks=257, max_num_seqs=16,
            max_num_batched_tokens=64)


def eos_after(req, pos: int) -> SampledToken:
    j = int(req.request_id.rsplit("#", 1)[1]) if "#" in req.request_id else 0
    k = req.prompt_token_ids[0] + j
    tok = EOS if pos == k else 10 + pos
    return SampledToken(tok, -(pos + 1) / 8 - j, np.zeros(0, np.int32), np.zeros(0, np.float32))


def fake_llm(token_fn=None) -> LLM:
    config = make_engine_config(ModelConfig.tiny(), **ARGS)
    fn = token_fn or counting_token(67, config.max_logprobs)
    runner = FakeRunner.for_config(config, token_fn=fn)
    return LLM(engine=LLMEngine(config, tokenizer=tiny_tokenizer(), runner=runner))


def ids(outs):
    return [o.outputs[0].token_ids for o in outs]


GREEDY = SamplingParams(max_tokens=4, temperature=0)
LISTS = [[5, 6, 7], [20], [30, 31]]


@pytest.mark.parametrize("make", [
    lambda: [np.array(p, np.int64) for p in LISTS],
    lambda: [jnp.array(p, jnp.int32) for p in LISTS],
    lambda: [[np.int64(t) for t in p] for p in LISTS],
    lambda: [np.array(p, np.uint8) for p in LISTS],
])
def test_array_prompts_equal_list_prompts(make):
    want = ids(fake_llm().generate(LISTS, GREEDY, use_tqdm=False))
    assert want[1] == [21, 22, 23, 24]  # counting tokens: last prompt token + 1, ...
    assert ids(fake_llm().generate(make(), GREEDY, use_tqdm=False)) == want


def test_single_1d_array_is_one_prompt():
    (out,) = fake_llm().generate(np.array([5, 6, 7]), GREEDY, use_tqdm=False)
    assert out.prompt_token_ids == [5, 6, 7] and out.outputs[0].token_ids == [8, 9, 10, 11]


def test_padded_batch_with_lengths_or_mask():
    want = ids(fake_llm().generate(LISTS, GREEDY, use_tqdm=False))
    padded = np.array([[5, 6, 7], [20, 0, 0], [30, 31, 0]])
    lengths = np.array([3, 1, 2])
    mask = np.arange(3)[None, :] < lengths[:, None]
    for kw in (dict(prompt_lengths=lengths), dict(prompt_mask=mask.astype(np.int32)),
               dict(prompt_mask=jnp.asarray(mask))):
        got = fake_llm().generate(jnp.asarray(padded), GREEDY, use_tqdm=False, **kw)
        assert ids(got) == want and [o.prompt_token_ids for o in got] == LISTS


@pytest.mark.parametrize("prompts, kw, match", [
    (np.array([[5, 6], [7, 8]]), dict(prompt_mask=np.array([[1, 1], [0, 1]])),
     "prompt_mask row 1 is not a prefix mask: 0 at position 0"),
    (np.array([[5, 6], [7, 8]]), dict(prompt_lengths=np.array([2, 3])),
     r"prompt_lengths\[1\]=3 is outside \[0, T=2\]"),
    (np.array([[5, 6], [7, 67]]), {}, r"prompts\[1\]: prompt\[1\]=67 is outside \[0, vocab_size=67\)"),
    ([np.array([5]), np.array([4, -1, 3])], {}, r"prompts\[1\]: prompt\[1\]=-1 is outside"),
    (np.array([[5, 6], [7, 8]]), dict(prompt_lengths=np.array([2, 0])), r"prompts\[1\]: .*empty"),
    (np.array([[5.0, 6.0]]), {}, "must be int"),
    ([[5, 6]], dict(prompt_lengths=[2]), "go with a padded"),
])
def test_bad_array_prompts_name_row_and_position(prompts, kw, match):
    llm = fake_llm()
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, GREEDY, use_tqdm=False, **kw)
    assert not llm.engine.has_unfinished_requests()  # all-or-nothing


@pytest.mark.parametrize("array", ["numpy", "jax"])
def test_rollout_arrays_round_trip_exactly(array):
    """Lengths 0..5 (first token EOS included), n=2, and a length-capped row."""
    llm = fake_llm(eos_after)
    prompts = [[k, 40] for k in range(5)]
    sp = SamplingParams(max_tokens=5, n=2, temperature=0.7, seed=1)
    outs, batch = llm.generate(prompts, sp, return_arrays=array, use_tqdm=False)
    cls = jax.Array if array == "jax" else np.ndarray
    assert all(isinstance(a, cls) for a in (batch.token_ids, batch.mask, batch.logprobs,
                                            batch.lengths, batch.prompt_index))
    tok, mask, lps = map(np.asarray, (batch.token_ids, batch.mask, batch.logprobs))
    assert tok.shape == (10, 5) and tok.dtype == np.int32 and lps.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(batch.prompt_index), np.repeat(np.arange(5), 2))
    r = 0
    for k, o in enumerate(outs):
        for j, c in enumerate(o.outputs):
            n_ok = k + j  # ordinary tokens before EOS
            want = ([10 + p for p in range(n_ok)] + [EOS])[:5]
            assert c.token_ids == want and tok[r, :len(want)].tolist() == want
            assert (tok[r, len(want):] == 0).all()
            assert mask[r].tolist() == [p < len(want) for p in range(5)]
            assert lps[r, :len(want)].tolist() == [-(p + 1) / 8 - j for p in range(len(want))]
            assert lps[r, :len(want)].tolist() == c.token_logprobs and (lps[r, len(want):] == 0).all()
            assert batch.finish_reasons[r] == ("length" if n_ok >= 5 else "stop")
            r += 1


def test_rollout_without_stop_token_has_zero_length_rows():
    llm = fake_llm(eos_after)
    outs = llm.generate([[0, 40], [2, 40], [9, 40]], SamplingParams(max_tokens=4, temperature=0),
                        use_tqdm=False)
    batch = rollout_arrays(outs, include_stop_token=False, pad_id=-1)
    assert outs[0].outputs[0].token_ids == [EOS]  # EOS sampled first
    assert batch.lengths.tolist() == [0, 2, 4]  # EOS dropped; the length-capped row keeps all
    assert batch.mask.tolist() == [[False] * 4, [True, True, False, False], [True] * 4]
    assert batch.token_ids.tolist() == [[-1] * 4, [10, 11, -1, -1], [10, 11, 12, 13]]
    assert batch.finish_reasons == ("stop", "stop", "length")


def test_rollout_of_all_empty_and_of_nothing():
    llm = fake_llm(eos_after)
    outs = llm.generate([[0, 40]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    b = rollout_arrays(outs, include_stop_token=False)
    assert b.token_ids.shape == (1, 0) and b.lengths.tolist() == [0]
    assert rollout_arrays([]).token_ids.shape == (0, 0)
    with pytest.raises(ValueError, match="array='torch'"):
        rollout_arrays(outs, array="torch")
