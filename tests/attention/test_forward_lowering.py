"""The real `forward_paged` lowers for CUDA with each Pallas backend, in both layer-loop forms.

tests/attention/test_lowering.py (Triton) and test_mosaic_lowering.py (Mosaic) lower
write_kv + attention in a hand-written layer loop; here the model's own forward
(`prepare_params(unroll_layers=...)`: a list of per-layer weights unrolled in
Python, or stacked weights under a `lax.scan` with the cache as the carry) runs
through the backend object the runner would get, for a tiny bf16 model with
SmolLM2's GQA ratio (9 / 3 heads) and head_dim 64. Each lowering must hold the
kernels' custom calls, called once per layer when unrolled and once in the scan body.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.attention.pallas_mosaic import PallasMosaicBackend
from jaxserve.attention.pallas_triton import PallasTritonBackend
from jaxserve.model.llama import Llama, forward_paged, prepare_params
from tests.attention.cases import empty_common
from tests.attention.test_lowering import TRITON_CALL, _h200_mesh
from tests.attention.test_mosaic_lowering import MOSAIC_CALL

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
L, T, S, B, P, N = 3, 64, 8, 16, 8, 32  # layers, bucket (T_pad, S_pad), page size, pages, pool


def _lower(backend, unroll: bool) -> str:
    cfg = ModelConfig.tiny(num_hidden_layers=L, num_attention_heads=9, num_key_value_heads=3,
                           head_dim=64, dtype="bfloat16")
    params = prepare_params(cfg, Llama(cfg, rngs=nnx.Rngs(0)), unroll_layers=unroll)
    md = backend.prepare(empty_common(T, S, P))
    sds = jax.ShapeDtypeStruct
    spec = lambda tree: jax.tree.map(lambda x: sds(x.shape, x.dtype), tree)  # noqa: E731
    cache = sds((L, N, B, 3, 64), jnp.bfloat16)
    ids = sds((T,), jnp.int32)

    def step(params, kv, ids, pos, md, logits_idx):
        return forward_paged(cfg, params, ids, pos, kv, md, logits_idx, backend=backend)

    with jax.sharding.use_abstract_mesh(_h200_mesh()):  # Triton reads the cc from it
        lowered = jax.jit(step, donate_argnums=(1,)).trace(
            spec(params), (cache, cache), ids, ids, spec(md), sds((S,), jnp.int32)
        ).lower(lowering_platforms=("cuda",))
    return lowered.as_text()


@pytest.mark.parametrize("unroll", [True, False], ids=["unrolled", "scan"])
def test_forward_paged_lowers_with_the_mosaic_kernel(unroll):
    be = PallasMosaicBackend(block_size=B, num_queries_per_kv=3, head_dim=64, dtype="bfloat16")
    text = _lower(be, unroll)
    assert text.count(MOSAIC_CALL) == 1  # one kernel function, called per layer
    assert text.count("call @ragged_paged_attention_mosaic(") == (L if unroll else 1)
    assert "ragged_paged_attention_mosaic_bq32_gp4_ck64_d64" in text  # T > 2 S: prefill tiles
    assert "stablehlo.scatter" in text  # the KV write stays an XLA scatter


@pytest.mark.parametrize("unroll", [True, False], ids=["unrolled", "scan"])
def test_forward_paged_lowers_with_the_triton_kernels(unroll):
    be = PallasTritonBackend(block_size=B, num_queries_per_kv=3, head_dim=64)
    text = _lower(be, unroll)
    assert text.count(TRITON_CALL) == 2  # the KV write and the attention kernel ...
    for fn in ("ragged_paged_attention", "write_kv_pallas"):  # ... per layer, or in the scan
        assert text.count(f"call @{fn}(") == (L if unroll else 1)
    assert "ragged_paged_attention_bq16_gp4_ppc4_bs16_d64" in text
    assert "kv_cache_update_k3_d64" in text
