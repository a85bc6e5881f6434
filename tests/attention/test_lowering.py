"""The Pallas kernels lower to Triton for CUDA on this CPU-only machine.

jax 0.12's Triton lowering asks for the GPU's compute capability; without a GPU it
reads it from an abstract device set with `jax.sharding.use_abstract_mesh`
(see jax/_src/pallas/triton/pallas_call_registration.py). We lower the engine's
real use: write_kv + attention inside a `lax.scan` over layers with the stacked
caches as the carry, at the bucket shapes and heads the engine runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from jaxserve.attention.pallas_triton import PallasTritonBackend
from tests.attention.cases import empty_common

TRITON_CALL = "__gpu$xla.gpu.triton"
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


def _h200_mesh():
    dev = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    return AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=dev)


def _lower_step(*, t, s, h, k, d, dtype, layers=2, blocks=64, block_size=16, pages=32):
    # Not interpret: this lowers the real kernels (no GPU is needed to lower for cuda).
    be = PallasTritonBackend(block_size=block_size, num_queries_per_kv=h // k, head_dim=d)
    md = be.prepare(empty_common(t, s, pages))
    sds = jax.ShapeDtypeStruct
    md_spec = jax.tree.map(lambda x: sds(x.shape, x.dtype), md)
    cache = sds((layers, blocks, block_size, k, d), dtype)

    def step(x, kc, vc, md):
        def layer_fn(carry, li):
            kc, vc = carry
            q = jnp.broadcast_to(x[:, None, :d], (t, h, d))
            kv = jnp.broadcast_to(x[:, None, :d], (t, k, d))
            kc, vc = be.write_kv(kc, vc, kv, kv, md, layer=li)
            o = be.attention(q, kc, vc, md, layer=li, sm_scale=d ** -0.5)
            return (kc, vc), o.sum()
        (kc, vc), ys = lax.scan(layer_fn, (kc, vc), jnp.arange(layers, dtype=jnp.int32))
        return ys, kc, vc

    with jax.sharding.use_abstract_mesh(_h200_mesh()):
        lowered = jax.jit(step, donate_argnums=(1, 2)).trace(
            sds((t, d), dtype), cache, cache, md_spec).lower(lowering_platforms=("cuda",))
    return lowered.as_text(), md.block_q


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("t,s,bq", [(256, 256, 4), (512, 64, 16)])  # decode / mixed buckets
def test_smollm2_variants_lower_to_triton(dtype, t, s, bq):
    text, block_q = _lower_step(t=t, s=s, h=9, k=3, d=64, dtype=dtype)
    assert block_q == bq
    assert text.count(TRITON_CALL) == 2  # the KV write and the attention kernel
    assert f"ragged_paged_attention_bq{bq}_gp4_ppc4_bs16_d64" in text
    assert "kv_cache_update_k3_d64" in text


def test_llama_heads_d128_lower_to_triton():
    text, _ = _lower_step(t=128, s=16, h=32, k=8, d=128, dtype=jnp.bfloat16)
    assert text.count(TRITON_CALL) == 2
    assert "ragged_paged_attention_bq16_gp4_ppc4_bs16_d128" in text


def test_tiny_model_head_dim_8_is_a_clear_error():
    with pytest.raises(ValueError, match="head_dim=8"):
        _lower_step(t=16, s=4, h=6, k=2, d=8, dtype=jnp.float32)
