"""Write new K/V rows into the paged cache through `slot_mapping`.

`slot_mapping[t] = block_id * B + offset` (vLLM's PagedAttention layout); padding
tokens point into the null block 0 and may collide there, which is harmless since
block 0 is never read as a real key (attention masks by `seq_lens`).

This file holds the Pallas Triton kernel, aliased in place (`write_kv_pallas`). The
XLA scatter is `jaxserve.attention.xla.write_kv_xla` and the NumPy reference
`jaxserve.attention.reference.reference_write_kv`. All take the stacked cache
[L, N, B, K, D] and a layer index, so that inside a `lax.scan` over layers the cache
can be the scan carry and is updated in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _kv_write_kernel(layer_ref, slot_ref,  # i32[1], i32[T]
                     k_ref, v_ref,  # [T, K, D]
                     kc_in, vc_in,  # [L, N*B, K, D], aliased to the outputs
                     kc_ref, vc_ref,  # [L, N*B, K, D]
                     *, num_kv_heads: int):
    del kc_in, vc_in  # same buffers as kc_ref / vc_ref (input_output_aliases)
    t = pl.program_id(0)
    slot = slot_ref[t]
    layer = layer_ref[0]
    # K need not be a power of two (SmolLM2 has 3): write one [D] row per head.
    for h in range(num_kv_heads):
        kc_ref[layer, slot, h, :] = k_ref[t, h, :].astype(kc_ref.dtype)
        vc_ref[layer, slot, h, :] = v_ref[t, h, :].astype(vc_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret",))
def write_kv_pallas(k_cache, v_cache, k, v, slot_mapping, layer, *, interpret: bool = False):
    """Pallas (Triton) KV write, in place through input_output_aliases.

    Args:
      k_cache, v_cache: [L, N, B, K, D] stacked caches (updated in place when the
        caller donates them or carries them through a scan).
      k, v: [T, K, D] new rows.
      slot_mapping: i32[T], block_id * B + offset; padding tokens -> block 0.
      layer: i32[] or i32[1].
      interpret: run with the Pallas interpreter (CPU tests).

    Returns:
      (k_cache, v_cache) with the rows written.

    Raises:
      ValueError: shape mismatch, or D not a power of two (Triton vector size).
    """
    n_layers, n_blocks, bs, kh, d = k_cache.shape
    t = k.shape[0]
    if k.shape != (t, kh, d) or v.shape != k.shape or v_cache.shape != k_cache.shape:
        raise ValueError(f"bad shapes: {k.shape=} {v.shape=} {k_cache.shape=} {v_cache.shape=}")
    if d & (d - 1):
        raise ValueError(f"pallas KV write needs head_dim={d} to be a power of two")
    flat = (n_layers, n_blocks * bs, kh, d)  # free reshape: slot indexes the N*B axis
    whole = pl.BlockSpec()
    kc, vc = pl.pallas_call(
        functools.partial(_kv_write_kernel, num_kv_heads=kh),
        grid=(t,),
        in_specs=[whole] * 6,
        out_specs=[whole, whole],
        out_shape=[jax.ShapeDtypeStruct(flat, k_cache.dtype),
                   jax.ShapeDtypeStruct(flat, v_cache.dtype)],
        input_output_aliases={4: 0, 5: 1},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name=f"kv_cache_update_k{kh}_d{d}",
    )(jnp.asarray(layer, jnp.int32).reshape(1), slot_mapping.astype(jnp.int32), k, v,
      k_cache.reshape(flat), v_cache.reshape(flat))
    return kc.reshape(k_cache.shape), vc.reshape(v_cache.shape)
