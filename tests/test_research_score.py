"""Scoring through the paged engine (issue 15): `LLM.score`, `SamplingParams.prompt_logprobs`.

The oracle is the model's plain, non-paged full-sequence forward
(`jaxserve.model.llama.reference_logits`: dense causal attention, no paging, no
padding, no buckets) with a float64 log_softmax: the engine's teacher-forced
logprob of token t must equal log_softmax(logits[t - 1])[token t] within 1e-4.
Budgets are small so completions are chunked over several steps.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from flax import nnx

from conftest import tiny_tokenizer
from jaxserve import LLM
from jaxserve.config import ModelConfig
from jaxserve.engine import LLMEngine, make_engine_config
from jaxserve.model.llama import Llama, reference_logits
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.fake_runner import FakeRunner

# max_num_batched_tokens=16: a 40-token row is prefilled in three chunks.
ARGS = dict(max_model_len=96, block_size=4, num_kv_blocks=96, max_num_seqs=4,
            max_num_batched_tokens=16, token_buckets=(8, 16), seq_buckets=(4,),
            attention_backend="xla", strict_compiles=True)
V = ModelConfig.tiny().vocab_size


@functools.lru_cache(maxsize=None)
def module() -> Llama:
    return Llama(ModelConfig.tiny(), rngs=nnx.Rngs(3), init_std=0.3)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM.from_module(module(), tiny_tokenizer(), **ARGS)


def log_softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def ref_scores(llm: LLM, seq: list[int]) -> np.ndarray:
    """f64[len(seq)]: log p(seq[t] | seq[:t]) by the plain forward; index 0 is NaN."""
    lp = log_softmax64(reference_logits(module().cfg, llm.engine.runner.params, np.array(seq)))
    out = np.full(len(seq), np.nan)
    out[1:] = lp[np.arange(len(seq) - 1), seq[1:]]
    return out


def rand_ids(rng, n: int) -> list[int]:
    return rng.integers(3, V, n).tolist()


def compiles(llm: LLM) -> tuple[int, int, int]:
    st = llm.engine.runner.stats()
    return st.programs_built, st.programs_loaded, st.late_compiles


def test_score_equals_the_full_sequence_forward_ragged_and_chunked(llm):
    rng = np.random.default_rng(0)
    # Ragged: prompts 1..13 tokens, completions 1..40 (> max_num_batched_tokens=16: chunked).
    shapes = [(1, 3), (5, 40), (13, 1), (2, 17), (7, 33)]
    prompts = [rand_ids(rng, p) for p, _ in shapes]
    comps = [rand_ids(rng, c) for _, c in shapes]
    before = compiles(llm)
    sb = llm.score(prompts, comps)
    assert compiles(llm) == before  # zero compiles after warm-up (the engine runs strict)
    assert sb.logprobs.shape == sb.mask.shape == (5, 40) and sb.logprobs.dtype == np.float32
    np.testing.assert_array_equal(sb.lengths, [c for _, c in shapes])
    for i, (p, c) in enumerate(zip(prompts, comps)):
        want = ref_scores(llm, p + c)[len(p):]
        np.testing.assert_allclose(sb.logprobs[i, :len(c)], want, atol=1e-4, rtol=0)
        assert sb.mask[i, :len(c)].all() and not sb.mask[i, len(c):].any()
        assert (sb.logprobs[i, len(c):] == 0).all()
    # The padded-array form and jax output give the same numbers.
    P = np.zeros((5, 13), np.int32)
    C = np.zeros((5, 40), np.int32)
    for i, (p, c) in enumerate(zip(prompts, comps)):
        P[i, :len(p)], C[i, :len(c)] = p, c
    sj = llm.score(P, C, prompt_lengths=[len(p) for p in prompts],
                   completion_lengths=[len(c) for c in comps], array="jax")
    np.testing.assert_allclose(np.asarray(sj.logprobs), sb.logprobs, atol=1e-6)
    assert not llm.engine.has_unfinished_requests()


def test_generate_logprobs_at_temperature_1_equal_score(llm):
    prompt = tiny_tokenizer().encode("the quick brown fox", add_special_tokens=True)
    sp = SamplingParams(max_tokens=24, temperature=1.0, seed=11, ignore_eos=True)
    (out,) = llm.generate([prompt], sp, use_tqdm=False)
    c = out.outputs[0]
    sb = llm.score([prompt], [c.token_ids])
    np.testing.assert_allclose(sb.logprobs[0, :len(c.token_ids)], c.token_logprobs, atol=1e-4)


def test_score_rows_with_empty_completions_and_errors(llm):
    sb = llm.score([[5, 6], [7]], [[], [8, 9]])
    assert sb.lengths.tolist() == [0, 2] and not sb.mask[0].any()
    np.testing.assert_allclose(sb.logprobs[1], ref_scores(llm, [7, 8, 9])[1:], atol=1e-4)
    with pytest.raises(ValueError, match=r"prompt_ids\[0\] is empty"):
        llm.score([[]], [[3]])
    with pytest.raises(ValueError, match="2 prompt rows but 1 completion rows"):
        llm.score([[3], [4]], [[5]])
    with pytest.raises(ValueError, match=r"row 0 .*outside \[0, vocab_size"):
        llm.score([[3]], [[V]])
    with pytest.raises(ValueError, match="max_model_len"):
        llm.score([[3] * 50], [[4] * 50])
    assert not llm.engine.has_unfinished_requests()


def test_prompt_logprobs_vllm_semantics(llm):
    rng = np.random.default_rng(1)
    prompt = rand_ids(rng, 30)  # two chunks of 16
    sp = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3, n=2)
    (out,) = llm.generate([prompt], sp, use_tqdm=False)
    pl = out.prompt_logprobs
    assert len(pl) == 30 and pl[0] is None
    lp = log_softmax64(reference_logits(module().cfg, llm.engine.runner.params, np.array(prompt)))
    for j in range(1, 30):
        row = lp[j - 1]
        top = np.argsort(-row)[:3]
        assert set(pl[j]) == set(top.tolist()) | {prompt[j]}
        for t, v in pl[j].items():
            assert v == pytest.approx(row[t], abs=1e-4)
    np.testing.assert_allclose(out.prompt_token_logprobs[1:], ref_scores(llm, prompt)[1:],
                               atol=1e-4)
    # prompt_logprobs=0: just the prompt token (vLLM); None: no field at all.
    (o0,) = llm.generate([prompt[:5]], sp.replace(prompt_logprobs=0, n=1), use_tqdm=False)
    assert [None if e is None else list(e) for e in o0.prompt_logprobs] == \
        [None] + [[t] for t in prompt[1:5]]
    (o1,) = llm.generate([prompt[:5]], sp.replace(prompt_logprobs=None, n=1), use_tqdm=False)
    assert o1.prompt_logprobs is None and o1.prompt_token_logprobs is None


def test_scoring_positions_never_come_from_the_prefix_cache(llm):
    kv = llm.engine.scheduler.kv_cache_manager
    prompt = list(range(10, 30))  # 20 tokens = 5 full blocks of 4
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    h0 = kv.prefix_cache_hits
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    assert kv.prefix_cache_hits - h0 == 16  # a plain request hits 4 blocks (last token computed)
    h0 = kv.prefix_cache_hits
    (o,) = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0),
                        use_tqdm=False)
    assert kv.prefix_cache_hits == h0  # prompt_logprobs needs position 0 on: no hits
    np.testing.assert_allclose(o.prompt_token_logprobs[1:], ref_scores(llm, prompt)[1:], atol=1e-4)
    # score(): the prompt's blocks below position len(prompt) - 1 may hit, the rest not.
    h0 = kv.prefix_cache_hits
    sb = llm.score([prompt[:14]], [prompt[14:]])
    assert kv.prefix_cache_hits - h0 == 12  # (14 - 1) // 4 = 3 blocks
    np.testing.assert_allclose(sb.logprobs[0], ref_scores(llm, prompt)[14:], atol=1e-4)


def test_preempted_scoring_request_keeps_each_position_once(llm):
    eng = llm.engine
    rng = np.random.default_rng(2)
    prompt = rand_ids(rng, 45)
    eng.add_request("pre", prompt, SamplingParams(max_tokens=1, temperature=0), logprob_start=3)
    outs = eng.step()  # first chunk of 16
    assert eng.scheduler.preempt("pre")
    while eng.has_unfinished_requests():
        outs += eng.step()
    (fin,) = [o for o in outs if o.finished]
    assert eng.scheduler.num_preemptions >= 1
    got = fin.prompt_token_logprobs
    assert np.isnan(got[:3]).all()
    np.testing.assert_allclose(got[3:], ref_scores(llm, prompt)[3:], atol=1e-4)


def test_scoring_off_is_a_clear_error():
    cfg = ModelConfig.tiny()
    config = make_engine_config(cfg, enable_prompt_logprobs=False, num_kv_blocks=32,
                                max_model_len=64, max_num_batched_tokens=16, max_num_seqs=4)
    eng = LLMEngine(config, tokenizer=None, runner=FakeRunner.for_config(config))
    assert eng.runner.stats().warmup_programs == len(eng.bucket_policy.program_keys())
    with pytest.raises(ValueError, match=r"prompt_logprobs=0: needs an engine started with "
                                         r"--enable_prompt_logprobs"):
        eng.add_request("x", [3, 4], SamplingParams(prompt_logprobs=0))
    with pytest.raises(ValueError, match="enable_prompt_logprobs=True"):
        LLM(engine=eng).score([[3]], [[4]])


def test_fake_runner_scores_chunks_and_preemptions_by_position():
    """The fake's hand-checkable scores (`jaxserve.worker.scoring.fake_scores`): token t scores
    -0.1 * (1 + t % 5), alternative i is (t + i) % V at -(0.1 + i); every index once."""
    cfg = ModelConfig.tiny()
    config = make_engine_config(cfg, num_kv_blocks=64, block_size=4, max_model_len=64,
                                max_num_batched_tokens=8, max_num_seqs=4, max_logprobs=4)
    eng = LLMEngine(config, tokenizer=None, runner=FakeRunner.for_config(config))
    prompt = list(range(20, 43))  # 23 tokens: 3 chunks of 8
    eng.add_request("f", prompt, SamplingParams(max_tokens=2, prompt_logprobs=2))
    outs = eng.step()
    eng.scheduler.preempt("f")
    while eng.has_unfinished_requests():
        outs += eng.step()
    final = outs[-1]
    assert final.finished and final.prompt_logprobs[0] is None
    for j in range(1, 23):
        t = prompt[j]
        assert final.prompt_logprobs[j] == pytest.approx(
            {t: -0.1 * (1 + t % 5), (t + 1) % V: -1.1, (t + 2) % V: -2.1})
    # Outputs before the prefill is complete carry no prompt logprobs.
    assert all(o.prompt_logprobs is None for o in outs if not o.outputs[0].token_ids)


def test_fake_many_completions_of_shared_prompts_score_every_position():
    """GRPO shape (prompts x 4 completions, block 16): rows sharing a prompt are admitted
    a step later as cache hits; the hit must stop below the first scored position even
    when the request's block-hash memo already holds more hashes (a deferred request)."""
    config = make_engine_config(ModelConfig.tiny(), num_kv_blocks=2000, max_model_len=256,
                                max_num_seqs=32, max_num_batched_tokens=256)
    llm = LLM(engine=LLMEngine(config, tokenizer=None, runner=FakeRunner.for_config(config)))
    rng = np.random.default_rng(0)
    ps, cs = [], []
    for _ in range(8):
        p = rng.integers(3, V, 15).tolist()
        for _ in range(4):
            ps.append(p)
            cs.append(rng.integers(3, V, 40).tolist())
    sb = llm.score(ps, cs)
    want = (-0.1 * (1 + np.array(cs) % 5)).astype(np.float32)
    np.testing.assert_allclose(sb.logprobs, want, atol=1e-6)
    assert llm.engine.scheduler.kv_cache_manager.prefix_cache_hits == 0  # (15 - 1) // 16 = 0
