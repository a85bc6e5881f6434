"""The online softmax of FlashAttention-2 (Dao 2023), shared by every attention kernel.

A row's softmax over keys that arrive in chunks is kept as a running state
(acc f32[..., D], m f32[...], l f32[...]): the largest score seen, the sum of
exp(score - m), and the exp-weighted sum of values. Each chunk rescales the
state by exp(m_old - m_new) and adds its own terms. The xla path's prefill
tiles and split-KV decode items and the Pallas kernel bodies all call
`online_softmax_step`, so the masking and NaN rules live here once:

* masked scores become MASK_VALUE, a finite number, so that `m_old - m_new`
  never computes inf - inf = NaN when a row has seen no valid key yet;
* masked probabilities are exactly 0, and `normalize` maps a row with no valid
  key at all (padding) to 0 instead of 0 / 0.

Only jnp ops on arrays are used, so the functions trace inside a Pallas
kernel body as well as in plain XLA code.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

# Finite, so that `m_old - m_new` never computes inf - inf = NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

# (acc f32[..., D], m f32[...], l f32[...])
SoftmaxState = tuple[jax.Array, jax.Array, jax.Array]


def init_state(rows: tuple[int, ...], head_dim: int) -> SoftmaxState:
    """The empty state of `rows` query rows: acc 0, m MASK_VALUE, l 0 (all f32)."""
    return (jnp.zeros((*rows, head_dim), jnp.float32), jnp.full(rows, MASK_VALUE, jnp.float32),
            jnp.zeros(rows, jnp.float32))


def online_softmax_step(state: SoftmaxState, s: jax.Array, valid: jax.Array,
                        pv: Callable[[jax.Array], jax.Array]) -> SoftmaxState:
    """Fold one chunk of scores into the running state.

    Args:
      state: (acc f32[..., D], m f32[...], l f32[...]).
      s: f32[..., C] scaled scores q.k of this chunk's C keys.
      valid: bool, broadcastable to s: keys this row may see (causal, in range).
      pv: p f32[..., C] -> f32[..., D], the probability-weighted sum of the chunk's
        values (the caller's matmul: einsum, tl.dot, or multiply + sum). Values of
        invalid keys must already be 0 there, since 0 * NaN would leak.

    Returns:
      The new state.
    """
    acc, m_i, l_i = state
    s = jnp.where(valid, s, MASK_VALUE)
    m_new = jnp.maximum(m_i, s.max(-1))
    alpha = jnp.exp(m_i - m_new)
    p = jnp.where(valid, jnp.exp(s - m_new[..., None]), 0.0)
    return acc * alpha[..., None] + pv(p), m_new, l_i * alpha + p.sum(-1)


def merge_into(state: SoftmaxState, rows: jax.Array, part: SoftmaxState) -> SoftmaxState:
    """Fold partial states `part` (leading axis W) into rows `rows` of `state` (leading axis R).

    The split-KV merge of flash-decoding (Dao et al. 2023), one batch of work items at
    a time: every row's state is rescaled to the new running max, then each item adds
    its own terms rescaled the same way. Several items may target the same row
    (scatter max / add), and an item of an empty chunk (m = MASK_VALUE, l = 0, acc = 0)
    changes nothing.

    Args:
      state: (acc f32[R, ..., D], m f32[R, ...], l f32[R, ...]).
      rows: i32[W] the row of each item, in [0, R).
      part: (acc f32[W, ..., D], m f32[W, ...], l f32[W, ...]).

    Returns:
      The merged state, shaped like `state`.
    """
    acc, m_i, l_i = state
    p_acc, p_m, p_l = part
    m_new = m_i.at[rows].max(p_m, mode="promise_in_bounds")
    alpha = jnp.exp(m_i - m_new)
    beta = jnp.exp(p_m - m_new[rows])
    acc = (acc * alpha[..., None]).at[rows].add(p_acc * beta[..., None], mode="promise_in_bounds")
    return acc, m_new, (l_i * alpha).at[rows].add(p_l * beta, mode="promise_in_bounds")


def normalize(acc: jax.Array, l_sum: jax.Array) -> jax.Array:
    """acc / l per row; rows that saw no valid key (l == 0) give 0, not NaN."""
    return acc / jnp.where(l_sum > 0.0, l_sum, 1.0)[..., None]
