"""The canonical parameter tree's shapes: a leaf module (no jax, no flax), so both the
pure forward (`jaxserve.model.llama`) and the NNX module (`jaxserve.model.nnx`)
import it without importing each other."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxserve.config import ModelConfig


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...] | dict[str, tuple[int, ...]]]:
    """The shape of every leaf of the canonical parameter tree for `cfg` (what `Llama` holds)."""
    L, E, F = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size
    H, K, D, V = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size
    shapes = {
        "embed": (V, E),
        "layers": {"attn_norm": (L, E), "wq": (L, E, H * D), "wk": (L, E, K * D),
                   "wv": (L, E, K * D), "wo": (L, H * D, E), "mlp_norm": (L, E),
                   "w_gate": (L, E, F), "w_up": (L, E, F), "w_down": (L, F, E)},
        "final_norm": (E,),
    }
    if cfg.attention_bias:
        shapes["layers"].update(bq=(L, H * D), bk=(L, K * D), bv=(L, K * D))
    if cfg.qk_norm:
        shapes["layers"].update(q_norm=(L, D), k_norm=(L, D))
    if cfg.sandwich_norms:
        shapes["layers"].update(post_attn_norm=(L, E), post_mlp_norm=(L, E))
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (E, V)
    return shapes


def empty_aligned(shape: tuple[int, ...], dtype: Any, align: int = 64) -> np.ndarray:
    """An uninitialised C-contiguous array at an `align`-byte address (NumPy's own
    allocations are 16-byte aligned), which CPU `device_put` can take without a copy."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buf = np.empty(nbytes + align, np.uint8)
    off = (-buf.ctypes.data) % align
    return buf[off:off + nbytes].view(dtype).reshape(shape)
