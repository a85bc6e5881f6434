"""The Mosaic GPU kernel lowers for CUDA on this CPU-only machine, in both layer-loop forms.

`jit(...).trace(...).lower(lowering_platforms=("cuda",))` runs Pallas' Mosaic GPU
lowering (Pallas -> Mosaic GPU MLIR, including its layout inference) without a GPU
and emits the `mosaic_gpu_v2` custom call holding the serialized module. PTX/SASS
generation happens only when XLA compiles for a real GPU (scripts/gpu_check.py).
We lower the engine's use through the backend object (`PallasMosaicBackend`): the
XLA KV scatter + the attention kernel per layer, over a stacked cache that is
donated, with the layers as a `lax.scan` (the cache is the carry, the layer index
traced) and as an unrolled Python loop. test_forward_lowering.py lowers the real
`forward_paged` with each backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from jaxserve.attention.pallas_mosaic import PallasMosaicBackend
from jaxserve.attention.kernels import ragged_paged_attention_mosaic as rpm
from tests.attention.cases import empty_common

MOSAIC_CALL = "custom_call @mosaic_gpu_v2"


def _lower_step(*, t, s, h, k, d, dtype, scan: bool, layers=2, blocks=64, block_size=16,
                pages=32, decode=True):
    tiles = rpm.default_tiles(h // k, block_size, head_dim=d, dtype=dtype, decode=decode)
    be = PallasMosaicBackend(block_size=block_size, num_queries_per_kv=h // k, head_dim=d,
                             dtype=jnp.dtype(dtype).name, tiles=tiles)
    md = be.prepare(empty_common(t, s, pages))
    sds = jax.ShapeDtypeStruct
    md_spec = jax.tree.map(lambda x: sds(x.shape, x.dtype), md)
    cache = sds((layers, blocks, block_size, k, d), dtype)

    def layer_fn(kc, vc, x, md, li):
        q = jnp.broadcast_to(x[:, None, :d], (t, h, d))
        kv = jnp.broadcast_to(x[:, None, :d], (t, k, d))
        kc, vc = be.write_kv(kc, vc, kv, kv, md, layer=li)
        o = be.attention(q, kc, vc, md, layer=li, sm_scale=d ** -0.5)
        return kc, vc, o.sum()

    def step(x, kc, vc, md):
        if scan:
            def body(carry, li):
                kc, vc, o = layer_fn(*carry, x, md, li)
                return (kc, vc), o
            (kc, vc), ys = lax.scan(body, (kc, vc), jnp.arange(layers, dtype=jnp.int32))
            return ys, kc, vc
        ys = []
        for li in range(layers):
            kc, vc, o = layer_fn(kc, vc, x, md, jnp.int32(li))
            ys.append(o)
        return jnp.stack(ys), kc, vc

    lowered = jax.jit(step, donate_argnums=(1, 2)).trace(
        sds((t, d), dtype), cache, cache, md_spec).lower(lowering_platforms=("cuda",))
    return lowered.as_text(), tiles


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_smollm2_heads_lower_to_mosaic(scan, dtype):
    text, tiles = _lower_step(t=256, s=64, h=9, k=3, d=64, dtype=dtype, scan=scan)
    assert tiles.block_q == 16  # Gp = 4
    assert text.count(MOSAIC_CALL) == 1  # one kernel function in the module ...
    # ... called once by the scan body, or once per layer when unrolled
    assert text.count("call @ragged_paged_attention_mosaic(") == (1 if scan else 2)
    assert "ragged_paged_attention_mosaic_bq16_gp4_ck64_d64" in text
    assert "stablehlo.scatter" in text  # the KV write stays an XLA scatter
    assert "tf.aliasing_output" in text or "jax.buffer_donor" in text  # donated caches


def test_prefill_tiles_lower_for_smollm2_and_llama_heads():
    # d64: 128-row prefill tiles; d128 keeps 64 rows (register budget, `default_tiles`).
    text, tiles = _lower_step(t=512, s=16, h=9, k=3, d=64, dtype=jnp.bfloat16, scan=True,
                              decode=False)
    assert tiles.block_q == 32 and text.count(MOSAIC_CALL) == 1
    assert "ragged_paged_attention_mosaic_bq32_gp4_ck64_d64" in text
    text, tiles = _lower_step(t=512, s=16, h=32, k=4, d=128, dtype=jnp.bfloat16, scan=True,
                              decode=False)
    assert tiles.block_q == 8 and "ragged_paged_attention_mosaic_bq8_gp8_ck64_d128" in text


def test_warp_specialized_variant_lowers():
    sds = jax.ShapeDtypeStruct
    tiles = rpm.MosaicTiles(block_q=16, pages_per_chunk=4, pipeline_depth=3, num_warpgroups=2)
    nt, s, p = 8, 4, 8
    args = [sds((32, 4, 64), jnp.bfloat16), sds((1, 16, 16, 1, 64), jnp.bfloat16),
            sds((1, 16, 16, 1, 64), jnp.bfloat16), sds((), jnp.int32), sds((s, p), jnp.int32)]
    args += [sds((nt,), jnp.int32)] * 4 + [sds((32,), jnp.int32)]
    fn = jax.jit(lambda *a: rpm.ragged_paged_attention_mosaic(*a, sm_scale=0.125, tiles=tiles))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(MOSAIC_CALL) == 1


def test_head_dim_the_kernel_cannot_tile_is_a_clear_error_before_lowering():
    with pytest.raises(ValueError, match="head_dim=8"):
        _lower_step(t=16, s=4, h=6, k=2, d=8, dtype=jnp.float32, scan=True)
