"""Multi-LoRA on the device: the pool's leaves and the forward's shrink / expand.

A step serves any mix of adapters with one compiled program (Punica, Chen et al. 2023;
S-LoRA, Sheng et al. 2023): every target projection of every layer carries the
stacked adapters of `max_loras` slots beside its base weight,

  lora_a_<target> [in, S, r]     lora_b_<target> [S, r, out]      (S = max_loras, r = max_lora_rank)

(with a leading [L] in the stacked-layer layout), B already scaled by lora_alpha / r
(`jaxserve.lora.adapter`); a smaller rank is zero-padded to r, and an empty slot is
zeros. Each token carries its row's slot (i32[T], 0 = base model, s >= 1 = pool index
s - 1). The delta is "shrink then expand" over the slots:

  u = h @ A.reshape(in, S*r)            [T, S*r]   (shrink: every slot's r columns)
  u = u * (slot(col) == slot(token))               (each token keeps its own slot's r)
  delta = u @ B.reshape(S*r, out)       [T, out]   (expand)

Two dense matmuls with K = S*r instead of a per-token gather of [in, r] / [r, out]
matrices (BGMV's gather): on XLA a gather materializes T*(in + out)*r values per
projection, which for a prefill bucket is larger than the base weight itself, while
the masked form costs S*r / in of the base matmul. When no token of the step has an
adapter, a `lax.cond` skips the delta: a base-only step pays one reduction over T
per projection (BUILD_NOTES.md, issue 27, measures both).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.model.linear import linear, linear_many


def lora_leaf_shapes(cfg: ModelConfig, max_loras: int, max_rank: int) -> dict[str, tuple]:
    """{leaf name: shape} of one layer's pool leaves (every target projection)."""
    from jaxserve.lora.adapter import target_shapes

    out = {}
    for t, (din, dout) in target_shapes(cfg).items():
        out[f"lora_a_{t}"] = (din, max_loras, max_rank)
        out[f"lora_b_{t}"] = (max_loras, max_rank, dout)
    return out


def lora_delta(h: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array) -> jax.Array:
    """The LoRA term of each token: h [T, in], a [in, S, r], b [S, r, out], slots i32[T]
    in [0, S] (0: none) -> [T, out] in h's dtype; zeros for slot-0 tokens."""
    din, S, r = a.shape
    T = h.shape[0]

    def delta(h):
        u = (h @ a.reshape(din, S * r)).reshape(T, S, r)  # shrink, all slots
        keep = (slots[:, None] - 1) == jnp.arange(S, dtype=slots.dtype)[None, :]  # [T, S]
        u = jnp.where(keep[:, :, None], u, 0).reshape(T, S * r)
        return u @ b.reshape(S * r, b.shape[-1])  # expand

    return jax.lax.cond(jnp.any(slots > 0), delta,
                        lambda h: jnp.zeros((T, b.shape[-1]), h.dtype), h)


def project(h: jax.Array, lp: dict, name: str, lora_slots: jax.Array | None) -> jax.Array:
    """h [T, in] @ lp[name] [in, out] (float or quantized: `model.linear`), plus the LoRA
    delta when the layer carries a pool (`lora_a_<name>`) and the step gives per-token
    slots; over quantized base weights the delta adds all the same."""
    return _plus_delta(linear(h, lp[name]), h, lp, name, lora_slots)


def project_many(h: jax.Array, lp: dict, names: "tuple[str, ...]",
                 lora_slots: jax.Array | None) -> tuple[jax.Array, ...]:
    """(project(h, lp, n, lora_slots) for n in names), the products in one call where
    `linear_many` can (q, k and v; gate and up)."""
    ys = linear_many(h, [lp[n] for n in names])
    return tuple(_plus_delta(y, h, lp, n, lora_slots) for n, y in zip(names, ys))


def _plus_delta(y: jax.Array, h: jax.Array, lp: dict, name: str,
                lora_slots: jax.Array | None) -> jax.Array:
    """y plus the LoRA delta of lp[name] for h, when the layer carries a pool and the step
    gives per-token slots; y itself otherwise."""
    a = lp.get(f"lora_a_{name}")
    if a is None or lora_slots is None:
        return y
    return y + lora_delta(h, a, lp[f"lora_b_{name}"], lora_slots)


def write_slot(pool: "list[dict] | dict", new: dict, slot: jax.Array) -> "list[dict] | dict":
    """The pool's layer leaves with slot index `slot` (i32[], 0-based) replaced.

    pool: the per-layer pool leaves, a list of L dicts (unrolled layers) of
      `lora_a_<t>` [in, S, r] / `lora_b_<t>` [S, r, out], or one dict of [L, ...] leaves.
    new: {leaf name: A [L, in, r] or B [L, r, out]}, rank padded to r, in the pool's dtype.
    """
    if isinstance(pool, dict):
        return {k: _put_a(v, new[k], slot) if k.startswith("lora_a_") else _put_b(v, new[k], slot)
                for k, v in pool.items()}
    return [{k: (_put_a(v, new[k][i], slot) if k.startswith("lora_a_")
                 else _put_b(v, new[k][i], slot)) for k, v in lp.items()}
            for i, lp in enumerate(pool)]


def _put_a(leaf: jax.Array, val: jax.Array, slot: jax.Array) -> jax.Array:
    """leaf [.., in, S, r] <- val [.., in, r] at slot (axis -2)."""
    return jax.lax.dynamic_update_slice_in_dim(leaf, val[..., None, :].astype(leaf.dtype),
                                               slot, axis=-2)


def _put_b(leaf: jax.Array, val: jax.Array, slot: jax.Array) -> jax.Array:
    """leaf [.., S, r, out] <- val [.., r, out] at slot (axis -3)."""
    return jax.lax.dynamic_update_slice_in_dim(leaf, val[..., None, :, :].astype(leaf.dtype),
                                               slot, axis=-3)
