"""The whole engine through each Pallas attention backend, on CPU, in interpret mode.

`EngineConfig.attention_interpret=True` (plain configuration, no monkeypatching)
makes the runner build its Pallas backend with `interpret=True`: the Triton
interpreter for "pallas_triton", Pallas' GPU interpreter (`plgpu.InterpretGPUParams`)
for "pallas_mosaic". A tiny random-weight fp32 model whose head_dim the kernels
accept (64: Mosaic tiles head_dim in multiples of 64) runs `LLM.generate` with
two sequences batched per step, a prompt longer than the token budget (chunked
prefill) and a KV pool too small for both (preemption by recompute). Greedy
tokens must equal the xla backend's on the same engine configuration, and one
mixed step's logits through `forward_paged` must agree with the xla backend's
within 1e-4.

Cost: the GPU interpreter takes ~0.3 s per program (query tile x KV head x
layer) on this CPU, so the model has one KV head (H = 3 pads to Gp = 4 rows
per token, the padded-head path) and the buckets are one (T 16, S 2) shape:
3 tiles x 1 KV head x 2 layers per step (~1 min per Pallas engine: slow).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.attention import CommonAttentionMetadata, get_attention_backend
from jaxserve.model.llama import forward_paged, prepare_params
from tests.attention.cases import load_gpu_check

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")]

# The model, prompts and engine settings of scripts/gpu_check.py's engine check (which
# runs this on the GPU against CPU goldens): vocab 67, hidden 48, intermediate 80, 2
# layers, 3 query heads over 1 KV head, head_dim 64, seeded random fp32 weights; pages
# of 8 tokens (the smallest the Mosaic kernel takes), 5 usable pages, 2 sequences of
# at most 16 tokens per step, prompts of 13, 19 (chunked) and 6 tokens.
GC = load_gpu_check()
B = GC.ENGINE_ARGS["block_size"]


@functools.lru_cache(maxsize=None)
def _generate(backend: str):
    """(greedy token ids per prompt, preemptions) of LLM.generate on `backend`."""
    tokens, engine = GC.engine_greedy(backend, interpret=backend != "xla")
    assert engine.runner.backend.name == backend
    assert getattr(engine.runner.backend, "interpret", False) == (backend != "xla")
    stats = engine.get_stats()
    assert stats["num_compiles_after_warmup"] == 0
    return tokens, stats["num_preemptions"]


@pytest.mark.parametrize("backend", ["pallas_triton", "pallas_mosaic"])
def test_greedy_tokens_equal_the_xla_path(backend):
    want, xla_preempted = _generate("xla")
    assert xla_preempted > 0, "pool too large: no preemption happened"
    assert all(len(t) == GC.ENGINE_MAX_TOKENS for t in want)
    assert max(GC.ENGINE_PROMPT_LENS) > GC.ENGINE_ARGS["max_num_batched_tokens"]  # chunked
    got, preempted = _generate(backend)
    assert preempted > 0
    assert got == want


def _mixed_step(cfg, num_tokens=16, num_seqs=2):
    """One step: a 9-token prefill chunk at context 12 (pages 3, 1) and a fresh 5-token prompt."""
    rng = np.random.default_rng(3)
    q_lens, seq_lens, pages = (9, 5), (12, 5), ([3, 1], [4])
    ids, pos, slots = [], [], []
    for q, s, pg in zip(q_lens, seq_lens, pages):
        p = np.arange(s - q, s)
        ids += list(rng.integers(3, cfg.vocab_size, size=q))
        pos += list(p)
        slots += list(np.asarray(pg)[p // B] * B + p % B)
    pad = num_tokens - len(ids)
    table = np.zeros((num_seqs, 4), np.int32)
    for i, pg in enumerate(pages):
        table[i, :len(pg)] = pg
    common = CommonAttentionMetadata(
        slot_mapping=np.array(slots + [0] * pad, np.int32),
        query_start_loc=np.array([0, 9, 14], np.int32), seq_lens=np.array(seq_lens, np.int32),
        block_table=table, num_seqs=np.int32(2))
    return (np.array(ids + [0] * pad, np.int32), np.array(pos + [0] * pad, np.int32), common,
            np.array([8, 13], np.int32))


def _logits(cfg, params, backend, kv, step):
    ids, pos, common, li = step
    fwd = jax.jit(lambda p, kv, md: forward_paged(cfg, p, ids, pos, kv, md, li, backend=backend))
    logits, _ = fwd(params, kv, jax.device_put(backend.prepare(common)))
    return np.asarray(logits)


@pytest.mark.parametrize("unroll", [True, False], ids=["unrolled", "scan"])
@pytest.mark.parametrize("name", ["pallas_triton", "pallas_mosaic"])
def test_prefill_logits_agree_with_xla(name, unroll):
    cfg, canon = GC.engine_model()
    params = prepare_params(cfg, canon, unroll_layers=unroll)
    # Pages 3 and 1 hold the chunked sequence's first 3 keys (written by an earlier
    # step); everything else is NaN, so a read of an unwritten slot shows up.
    shape = (cfg.num_hidden_layers, 8, B, cfg.num_key_value_heads, cfg.head_dim)
    rng = np.random.default_rng(5)
    kc, vc = np.full(shape, np.nan, np.float32), np.full(shape, np.nan, np.float32)
    kc[:, 3, :3], vc[:, 3, :3] = rng.standard_normal((2, cfg.num_hidden_layers, 3, 1,
                                                           cfg.head_dim))
    kv = (jnp.asarray(kc), jnp.asarray(vc))
    step = _mixed_step(cfg)
    want = _logits(cfg, params, get_attention_backend("xla", cfg, block_size=B), kv, step)
    backend = get_attention_backend(name, cfg, block_size=B, interpret=True)
    got = _logits(cfg, params, backend, kv, step)
    assert np.isfinite(want).all() and np.abs(want).max() > 1.0  # not a vacuous comparison
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
