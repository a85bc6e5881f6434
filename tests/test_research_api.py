"""Research-pipeline API (issue 15): an engine from an NNX module, `update_params`
without recompiling, and its failure rules, on the tiny model.

References are independent engines built fresh from the same weights: after
`update_params(B)` the greedy outputs must equal those of an engine built from B.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from flax import nnx

from conftest import tiny_tokenizer
from jaxserve import LLM
from jaxserve.config import ModelConfig
from jaxserve.model.llama import Llama
from jaxserve.sampling_params import SamplingParams

# One bucket shape keeps each engine's warm-up to a single program.
ARGS = dict(max_model_len=64, block_size=4, num_kv_blocks=64, max_num_seqs=4,
            max_num_batched_tokens=32, token_buckets=(32,), seq_buckets=(4,),
            attention_backend="xla")
GREEDY = SamplingParams(max_tokens=6, temperature=0)


@functools.lru_cache(maxsize=None)
def module(seed: int) -> Llama:
    return Llama(ModelConfig.tiny(), rngs=nnx.Rngs(seed), init_std=0.3)


@functools.lru_cache(maxsize=None)
def reference(seed: int, prompts: tuple[str, ...]) -> list[list[int]]:
    """Greedy token ids of a fresh engine built from `nnx.state` of module(seed)."""
    m = module(seed)
    llm = LLM.from_module(nnx.state(m), tiny_tokenizer(), cfg=m.cfg, **ARGS)
    return [o.outputs[0].token_ids for o in llm.generate(list(prompts), GREEDY, use_tqdm=False)]


def ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def compiles(llm: LLM) -> tuple[int, int, int]:
    st = llm.engine.runner.stats()
    return st.programs_built, st.programs_loaded, st.late_compiles


@pytest.fixture(scope="module")
def llm_a() -> LLM:
    return LLM.from_module(module(0), tiny_tokenizer(), **ARGS)


PROMPTS = ("the quick brown fox", "jumps over the lazy", "dog and then")


def test_from_module_needs_a_cfg_for_a_state():
    with pytest.raises(ValueError, match="cfg=ModelConfig"):
        LLM.from_module(nnx.state(module(0)), tiny_tokenizer(), **ARGS)


def test_update_params_toy_loop(llm_a):
    """generate(A) -> update_params(B) -> generate == fresh engine of B; no compile; no
    prefix-cache reuse of A's blocks; update back to A reproduces A."""
    eng = llm_a.engine
    kv = eng.scheduler.kv_cache_manager
    out_a = ids(llm_a.generate(list(PROMPTS), GREEDY, use_tqdm=False))
    assert out_a == reference(0, PROMPTS)
    hits0 = kv.prefix_cache_hits
    assert ids(llm_a.generate(list(PROMPTS), GREEDY, use_tqdm=False)) == out_a
    assert kv.prefix_cache_hits > hits0  # without an update A's prompt blocks are reused
    c0, v0 = compiles(llm_a), llm_a.weight_version
    assert llm_a.update_params(module(1)) == v0 + 1 == llm_a.weight_version
    assert eng.get_stats()["weight_version"] == v0 + 1
    hits1 = kv.prefix_cache_hits
    out_b = ids(llm_a.generate(list(PROMPTS), GREEDY, use_tqdm=False))
    assert kv.prefix_cache_hits == hits1  # A's cached blocks were forgotten
    assert out_b == reference(1, PROMPTS) and out_b != out_a
    assert compiles(llm_a) == c0
    llm_a.update_params(nnx.state(module(0)))  # and back, through the nnx.State path
    assert ids(llm_a.generate(list(PROMPTS), GREEDY, use_tqdm=False)) == out_a
    assert compiles(llm_a) == c0


def _tree(seed: int) -> dict:
    return nnx.to_pure_dict(nnx.state(module(seed)))


@pytest.mark.parametrize("mutate, match", [
    (lambda t: t["layers"].update(wq=np.zeros((1, 2, 3), np.float32)), "/layers/wq has shape"),
    (lambda t: t["layers"].pop("w_down"), r"parameter tree at /layers: keys"),
    (lambda t: t.update(final_norm=np.ones(t["final_norm"].shape, np.int32)),
     "/final_norm has dtype int32"),
])
def test_bad_update_raises_and_old_weights_keep_serving(llm_a, mutate, match):
    tree = jax_to_numpy(_tree(1))
    mutate(tree)
    llm_a.update_params(module(0))
    v0, c0 = llm_a.weight_version, compiles(llm_a)
    with pytest.raises(ValueError, match=match):
        llm_a.update_params(tree)
    assert llm_a.weight_version == v0 and compiles(llm_a) == c0
    assert ids(llm_a.generate(list(PROMPTS), GREEDY, use_tqdm=False)) == reference(0, PROMPTS)


def jax_to_numpy(tree):
    import jax

    return jax.tree.map(np.asarray, tree)


def test_update_fails_requests_in_flight_clearly(llm_a):
    eng = llm_a.engine
    eng.add_request("inflight", "the quick", SamplingParams(max_tokens=20, temperature=0))
    eng.step()
    assert eng.has_unfinished_requests()
    v = eng.update_params(module(1))
    # The request is finished, but its error output still awaits step(): a drain loop
    # `while has_unfinished_requests(): step()` must get to deliver it.
    assert eng.has_unfinished_requests()
    (out,) = eng.step()
    assert not eng.has_unfinished_requests()
    assert out.request_id == "inflight" and out.finished
    c = out.outputs[0]
    assert c.finish_reason == "error" and f"to {v}" in c.error and len(c.token_ids) == 1
    kv = eng.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    eng.update_params(module(0))


def test_engine_logprobs_modes_match_numpy_over_model_logits(llm_a):
    """Per-token logprobs of a seeded, filtered sample: raw = log_softmax of the model's
    logits, processed = log of the float64 renormalised top-k/top-p distribution at T."""
    from jaxserve.model.llama import reference_logits
    from sample.test_sampler import _log_softmax64, _ref_probs

    llm_a.update_params(module(0))
    m = module(0)
    proc = LLM.from_module(m, tiny_tokenizer(), logprobs_mode="processed_logprobs", **ARGS)
    sp = SamplingParams(max_tokens=5, temperature=0.8, top_k=12, top_p=0.9, seed=7)
    prompt = tiny_tokenizer().encode("the quick brown", add_special_tokens=True)
    (raw_out,), (proc_out,) = (x.generate([prompt], sp, use_tqdm=False) for x in (llm_a, proc))
    c_raw, c_proc = raw_out.outputs[0], proc_out.outputs[0]
    assert c_raw.token_ids == c_proc.token_ids  # the mode never changes what is sampled
    seq = prompt + c_raw.token_ids
    logits = reference_logits(m.cfg, proc.engine.runner.params, np.array(seq))
    for p, tok in enumerate(c_raw.token_ids):
        row = logits[len(prompt) + p - 1]
        np.testing.assert_allclose(c_raw.token_logprobs[p], _log_softmax64(row)[tok], atol=1e-4)
        want = np.log(_ref_probs(row, 0.8, 12, 0.9)[tok])
        np.testing.assert_allclose(c_proc.token_logprobs[p], want, atol=1e-4)
    assert sum(c_proc.token_logprobs) == pytest.approx(c_proc.cumulative_logprob, abs=1e-5)
    assert c_proc.token_logprobs != pytest.approx(c_raw.token_logprobs, abs=1e-3)


def test_update_from_arrays_on_another_sharding_is_resharded(llm_a):
    """Weights committed with a sharding other than the engine's (a 1-device training
    mesh, NamedSharding with a partitioned axis) are resharded to the engine's: same
    outputs as a fresh engine, same shardings as before, nothing recompiled. (The
    multi-device reshard test waits for the tensor-parallel branch.)"""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    tree = jax.tree.map(
        lambda a: jax.device_put(a, NamedSharding(mesh, PartitionSpec("fsdp"))), _tree(1))
    assert all(isinstance(a.sharding, NamedSharding) for a in jax.tree.leaves(tree))
    runner = llm_a.engine.runner
    before = [a.sharding for a in jax.tree.leaves(runner.params)]
    assert not any(isinstance(s, NamedSharding) for s in before)
    c0 = compiles(llm_a)
    llm_a.update_params(tree)
    assert [a.sharding for a in jax.tree.leaves(runner.params)] == before
    assert ids(llm_a.generate(list(PROMPTS), GREEDY, use_tqdm=False)) == reference(1, PROMPTS)
    assert compiles(llm_a) == c0
    llm_a.update_params(module(0))


def test_generate_assembles_only_final_outputs_and_stream_every_step(llm_a, monkeypatch):
    """LLM.generate runs FINAL_ONLY (vLLM): one CompletionOutput is built per sample, the
    tokens equal generate_stream's, which gets an output every step."""
    from jaxserve.engine.output_processor import OutputProcessor

    built = []
    real = OutputProcessor._completion
    monkeypatch.setattr(OutputProcessor, "_completion",
                        staticmethod(lambda c, *a: built.append(c.index) or real(c, *a)))
    direct = OutputProcessor._direct_output  # a one-sample stream's outputs, in one pass
    monkeypatch.setattr(OutputProcessor, "_direct_output",
                        lambda self, c, *a: built.append(c.index) or direct(self, c, *a))
    outs = llm_a.generate(list(PROMPTS), GREEDY, use_tqdm=False)
    assert len(built) == len(PROMPTS) and all(o.finished for o in outs)
    built.clear()
    streamed = list(llm_a.generate_stream(list(PROMPTS), GREEDY))
    assert len(built) == len(streamed) >= len(PROMPTS) * GREEDY.max_tokens
    final = {o.request_id: o.outputs[0].token_ids for o in streamed if o.finished}
    order = sorted(final, key=lambda rid: int(rid.rsplit("-", 1)[1]))  # gen-N: submit order
    assert [final[r] for r in order] == ids(outs)
