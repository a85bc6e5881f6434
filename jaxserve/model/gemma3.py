"""The Gemma 3 (text) decoder block, beside the Llama one it shares its pieces with.

Gemma 3 (Team Gemma, "Gemma 3 Technical Report", 2025), as HF transformers'
Gemma3DecoderLayer computes it, over the flat ragged token axis:

  h = norm_in(x); q, k, v = h Wq, h Wk, h Wv; q, k = q_norm(q), k_norm(k) (per head)
  q, k = RoPE(q, k) with base rope_local_base_freq on sliding layers, rope_theta on
    global ones; o = attention(q, k, v) with scale query_pre_attn_scalar ** -0.5 and,
    on sliding layers, the window
  x = x + post_attn_norm(o Wo)
  x = x + post_mlp_norm(W_down (gelu_tanh(h' W_gate) * h' W_up)), h' = mlp_norm(x)

Every RMSNorm is Gemma's `x * (1 + w)`; the loaders store `1 + w` (llama.cpp's GGUF
already does), so `llama.rms_norm` serves. The embeddings are scaled by
sqrt(hidden_size) (`llama.embed_tokens`) and the logits soft-capped when the config
says so (`llama.compute_logits`). Five local layers to one global (`cfg.layer_types`)
is data: the layer's window and RoPE table are looked up by its index, so one
compiled layer program serves both kinds.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxserve.config import ModelConfig
from jaxserve.model.lora import project, project_many
from jaxserve.model.ops import apply_rope, rms_norm


def activation(cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """The MLP gate's activation: SiLU (Llama) or GELU with the tanh approximation (Gemma,
    transformers' "gelu_pytorch_tanh")."""
    if cfg.hidden_act == "gelu_pytorch_tanh":
        return jax.nn.gelu(x, approximate=True)
    return jax.nn.silu(x)


def decoder_layer(cfg: ModelConfig, x: jax.Array, lp: dict[str, jax.Array], positions: jax.Array,
                  inv_freq: jax.Array, attn_fn: Any, attn_carry: Any, layer: Any, *,
                  window: jax.Array | None, lora_slots: jax.Array | None = None
                  ) -> tuple[jax.Array, Any]:
    """One Gemma 3 block on x [T, E]; returns (x [T, E], attn_carry).

    inv_freq: f32[D/2], this layer's RoPE table (local or global, chosen by the caller);
    window: i32[] keys a query sees on this layer, or None (a global layer of a model
    with no sliding layer); lora_slots: i32[T] per-token LoRA slots, or None. Every
    projection goes through `lora.project` / `project_many` (float or quantized weights,
    plus the delta).
    """
    T = x.shape[0]
    H, K, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    eps = cfg.rms_norm_eps
    h = rms_norm(x, lp["attn_norm"], eps)
    def proj(a: jax.Array, name: str) -> jax.Array:
        return project(a, lp, name, lora_slots)

    q, k, v = project_many(h, lp, ("wq", "wk", "wv"), lora_slots)
    q, k, v = q.reshape(T, H, D), k.reshape(T, K, D), v.reshape(T, K, D)
    q = apply_rope(rms_norm(q, lp["q_norm"], eps), positions, inv_freq)
    k = apply_rope(rms_norm(k, lp["k_norm"], eps), positions, inv_freq)
    o, attn_carry = attn_fn(q, k, v, attn_carry, layer, window)  # [T, H, D]
    x = x + rms_norm(proj(o.reshape(T, H * D), "wo"), lp["post_attn_norm"], eps)
    h = rms_norm(x, lp["mlp_norm"], eps)
    gate, up = project_many(h, lp, ("w_gate", "w_up"), lora_slots)
    h = proj(activation(cfg, gate) * up, "w_down")
    return x + rms_norm(h, lp["post_mlp_norm"], eps), attn_carry
