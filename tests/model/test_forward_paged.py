"""forward_paged through each backend object (Pallas in interpret mode) vs the dense reference.

Two steps on a tiny model with head_dim 16 (the smallest the Triton kernels tile),
plain and with the Qwen switches (q/k/v biases, per-head q/k norms) on:
a prefill of two prompts, then one decode each, which reads the cache the first
step wrote. Both the xla and the Pallas backend (write_kv and attention both in
interpret mode, chosen through `get_attention_backend`) must match
`reference_logits`, an unpaged dense forward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.attention import CommonAttentionMetadata, get_attention_backend
from jaxserve.model.llama import Llama, canonical_params, forward_paged, prepare_params, reference_logits

B, N, P = 4, 8, 4  # block size, pool blocks, max blocks per sequence
PROMPTS = ([5, 17, 3, 60, 22], [9, 41, 33])
PAGES = ([1, 2], [3])  # block table rows, deliberately not starting at 0


def _step(seqs, num_tokens=16, num_seqs=4):
    """Host arrays of one step; seqs = [(seq index, first position, number of new tokens)]."""
    ids, pos, slots, qsl, seq_lens, logits_idx = [], [], [], [0], [], []
    for s, start, n in seqs:
        ids += list(PROMPTS[s] + [7])[start:start + n]
        p = np.arange(start, start + n)
        pos += list(p)
        slots += list(np.asarray(PAGES[s])[p // B] * B + p % B)
        qsl.append(qsl[-1] + n)
        seq_lens.append(start + n)
        logits_idx.append(qsl[-1] - 1)
    pad_t, pad_s = num_tokens - len(ids), num_seqs - len(seqs)
    table = np.zeros((num_seqs, P), np.int32)
    for i, (s, _, _) in enumerate(seqs):
        table[i, :len(PAGES[s])] = PAGES[s]
    common = CommonAttentionMetadata(
        slot_mapping=np.array(slots + [0] * pad_t, np.int32),
        query_start_loc=np.array(qsl + [qsl[-1]] * pad_s, np.int32),
        seq_lens=np.array(seq_lens + [0] * pad_s, np.int32), block_table=table,
        num_seqs=np.int32(len(seqs)))
    return (np.array(ids + [0] * pad_t, np.int32), np.array(pos + [0] * pad_t, np.int32),
            common, np.array(logits_idx + [0] * pad_s, np.int32))


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("name", ["xla", "pallas"])
@pytest.mark.parametrize("unroll", [True, False], ids=["unrolled", "scan"])
@pytest.mark.parametrize("switches,fuse", [({}, False), ({"attention_bias": True, "qk_norm": True}, True)],
                         ids=["llama", "bias+qk_norm+fused"])
def test_two_steps_match_the_dense_reference(name, unroll, switches, fuse):
    cfg = ModelConfig.tiny(head_dim=16, **switches)
    model = Llama(cfg, rngs=nnx.Rngs(1), init_std=0.3)
    canon = jax.tree.map(np.asarray, canonical_params(model))
    backend = get_attention_backend(name, cfg, block_size=B, interpret=True)
    params = prepare_params(cfg, model, unroll_layers=unroll, fuse=fuse)
    shape = (cfg.num_hidden_layers, N, B, cfg.num_key_value_heads, cfg.head_dim)
    kv = (jnp.zeros(shape), jnp.zeros(shape))
    fwd = jax.jit(lambda p, ids, pos, kv, md, li: forward_paged(cfg, p, ids, pos, kv, md, li,
                                                                backend=backend))
    for seqs in ([(0, 0, 5), (1, 0, 3)], [(0, 5, 1), (1, 3, 1)]):  # prefill, then one decode
        ids, pos, common, li = _step(seqs)
        logits, kv = fwd(params, ids, pos, kv, jax.device_put(backend.prepare(common)), li)
        for row, (s, start, n) in enumerate(seqs):
            full = (PROMPTS[s] + [7])[:start + n]
            want = reference_logits(cfg, canon, np.array(full))[-1]
            np.testing.assert_allclose(np.asarray(logits[row]), want, atol=1e-4, rtol=1e-4)
