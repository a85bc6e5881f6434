"""The layer stack of a token bucket as layer-group programs (issue 12).

A one-program stack unrolls all L decoder layers into one XLA program: on this
CPU its cold compile is ~15 s per token bucket for SmolLM2 (30 layers), and each
loaded one holds ~168 MiB of host heap. Here the stack of a token bucket T_pad is
three small AOT programs instead:

  embed   (embed [V, E], input_ids i32[T]) -> x [T, E]
  layers  (G layers' weights, their K and V caches, x, positions, attention
          metadata, the G layers' indices i32[G]) -> (x, the G new K caches, the G
          new V caches); the indices pick each layer's sliding window and RoPE table
          (data: one program serves local and global layers)
  final   (final_norm [E], x, logits_indices i32[S_max]) -> (rows [S_max, E],
          hidden [T, E])

and a step calls `layers` L / G times from the host, each call on the next G
layers' own weight buffers and KV cache buffers (each cache [N, B, K, D], donated
call by call so XLA updates it in place). The same compiled `layers` program
serves every group because every group has the same shapes. G = L is the
one-program stack; G = 1 compiles ~7x faster at the same step time
(`scripts/profile_layer_groups.py`, notes/startup.md). The per-layer-program form
is the one the start-up issue lists ("one per-layer program called L times from
the host, with the KV cache donated layer by layer"); vLLM's piecewise CUDA
graphs split a forward the same way, at attention.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.attention import AttentionBackend
from jaxserve.model.llama import (decoder_layer, embed_tokens, paged_attn, rms_norm,
                                  rope_inv_freq)


def embed_fn(cfg: ModelConfig, embed: jax.Array, input_ids: jax.Array) -> jax.Array:
    """Token embedding: embed [V, E] gathered at input_ids i32[T] -> [T, E] (scaled by
    sqrt(E) for Gemma, `llama.embed_tokens`; float or quantized)."""
    return embed_tokens(cfg, embed, input_ids)


def layers_fn(cfg: ModelConfig, backend: AttentionBackend, layer_params: list, k_caches: list,
              v_caches: list, x: jax.Array, positions: jax.Array, attn_md: Any,
              layer_ids: jax.Array, lora_slots: jax.Array | None = None
              ) -> tuple[jax.Array, list, list]:
    """G decoder layers on x [T, E]: layer_params is a list of G per-layer weight dicts
    (`prepare_params(unroll_layers=True)`'s), k_caches / v_caches lists of their G
    caches, each [N, B, K, D] in cfg.dtype (donate them), layer_ids i32[G] their
    indices in the model (a layer's sliding window and RoPE table). Returns (x [T, E],
    the G new K caches, the G new V caches)."""
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    attn = paged_attn(cfg, attn_md, backend)
    ks, vs = [], []
    for i, (lp, kc, vc) in enumerate(zip(layer_params, k_caches, v_caches, strict=True)):
        x, (kc, vc) = decoder_layer(cfg, x, lp, positions, inv_freq, attn, (kc, vc), None,
                                    layer_index=layer_ids[i], lora_slots=lora_slots)
        ks.append(kc)
        vs.append(vc)
    return x, ks, vs


def group_layer_ids(num_layers: int, group: int, sharding: Any = None) -> tuple[jax.Array, ...]:
    """The layer indices i32[G] of each G-layer group, as device arrays (made once;
    placed with `sharding` under a mesh)."""
    return tuple(jax.device_put(np.arange(s, s + group, dtype=np.int32), sharding)
                 for s in range(0, num_layers, group))


def final_fn(cfg: ModelConfig, final_norm: jax.Array, x: jax.Array, logits_indices: jax.Array
             ) -> tuple[jax.Array, jax.Array]:
    """Final RMSNorm of x [T, E] -> (rows at logits_indices i32[S_max] [S_max, E], all
    normed rows [T, E] (the score program's input))."""
    hidden = rms_norm(x, final_norm, cfg.rms_norm_eps)
    return hidden[logits_indices], hidden


@dataclasses.dataclass(frozen=True)
class LayerStackProgram:
    """One token bucket's stack: its three compiled programs and the group size G.

    Called like the one-program stack: (params, kv_cache, batch) -> (rows [S_max, E],
    kv_cache, hidden [T, E]), where params is the unrolled engine layout and kv_cache
    is (L K caches, L V caches), each [N, B, K, D]. If a call fails midway, the caches
    already donated are deleted and the runner's `reset()` replaces the whole cache.
    """

    embed: Any  # jax.stages.Compiled
    layers: Any
    final: Any
    group: int
    # i32[G] device arrays, the layer indices of each group (`group_layer_ids`), made on
    # the first call with the sharding the compiled layers program takes them in
    layer_ids: tuple = ()

    def __call__(self, params: dict, kv_cache: tuple, batch: Any) -> tuple[Any, tuple, Any]:
        x = self.embed(params["embed"], batch.input_ids)
        ks, vs = list(kv_cache[0]), list(kv_cache[1])
        lps, g = params["layers"], self.group
        if not self.layer_ids:
            shardings = getattr(self.layers, "input_shardings", None)
            object.__setattr__(self, "layer_ids", group_layer_ids(
                len(lps), g, shardings[0][6] if shardings else None))  # arg 6: layer_ids
        ids = self.layer_ids
        for j, s in enumerate(range(0, len(lps), g)):
            x, ks[s:s + g], vs[s:s + g] = self.layers(lps[s:s + g], ks[s:s + g], vs[s:s + g], x,
                                                      batch.positions, batch.attn_md, ids[j],
                                                      batch.lora_slots)
        rows, hidden = self.final(params["final_norm"], x, batch.logits_indices)
        return rows, (tuple(ks), tuple(vs)), hidden

    @property
    def out_info(self) -> Any:
        """(rows, hidden) specs, as the one-program stack's out_info[0] / [2]."""
        return self.final.out_info
