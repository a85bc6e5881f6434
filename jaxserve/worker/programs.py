"""The step's programs as pure functions of (params, kv_cache, batch arrays).

`_stack_fn` (one per token bucket T_pad), `_head_fn` (one per seq bucket S_pad) and
`_score_fn` (one per T_pad, steps with scoring rows only) are jitted and compiled
ahead of time by `jaxserve.worker.model_runner.ModelRunner`; with unrolled layers a
stack is the three programs of `jaxserve.worker.layer_stack` instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.attention import AttentionBackend
from jaxserve.config import ModelConfig
from jaxserve.model.llama import compute_logits, paged_attn, run_layers
from jaxserve.sample.sampler import SamplingMetadata, sample


def _spec(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    """The step's inputs at bucket shape (T = T_pad, S = S_pad); NumPy leaves on the
    host, device arrays after the one `device_put`."""

    input_ids: Any  # i32[T] token ids; padding 0
    positions: Any  # i32[T] position of each token; padding 0
    attn_md: Any  # the attention backend's metadata (`backend.prepare`), a registered dataclass
    logits_indices: Any  # i32[S] flat token index of each row's last token; padding 0
    sampling: SamplingMetadata  # per-row sampling parameters, [S] leading axis
    lora_slots: Any = None  # i32[T] each token's LoRA slot (0 = none); None: LoRA off


def _stack_fn(cfg: ModelConfig, backend: AttentionBackend, params, kv_cache, batch: StepBatch):
    """Layer-stack program (one per T_pad): the decoder over the padded tokens, then the
    final-normed hidden rows at logits_indices, f32/cfg.dtype [S_max, E], the cache, and
    all final-normed hidden rows [T_pad, E] (the score program's input; they stay on the
    device). `batch.sampling` is None here. Equals `llama.forward_paged` up to the LM head."""
    hidden, kv_cache = run_layers(cfg, params, batch.input_ids, batch.positions,
                                  paged_attn(cfg, batch.attn_md, backend), kv_cache,
                                  batch.lora_slots)
    return hidden[batch.logits_indices], kv_cache, hidden


# Rows of one chunk of the score program: its f32 logits stay under ~32 MiB (Gemma 3's
# 262,144-token vocabulary would otherwise hold T_pad x 1 MiB: 256 MiB at T_pad 256).
SCORE_CHUNK_ELEMENTS = 1 << 23


def _score_fn(cfg: ModelConfig, k: int, params, hidden, targets):
    """Score program (one per T_pad, only in steps with scoring rows): LM head over every
    hidden row [T_pad, E], log_softmax, then each row's target logprob f32[T_pad] and the
    top-k ids i32[T_pad, k] / logprobs f32[T_pad, k] (k = max_logprobs; raw logprobs, as
    vLLM's prompt_logprobs). `targets` i32[T_pad] (`jaxserve.worker.scoring.ScoringPlan`).
    When T_pad x V exceeds SCORE_CHUNK_ELEMENTS the rows go through in chunks
    (`lax.map`), so the logits held at once are bounded whatever the vocabulary."""
    t, rows = hidden.shape[0], max(1, SCORE_CHUNK_ELEMENTS // cfg.vocab_size)
    if t > rows:
        pad = -t % rows
        h = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(-1, rows, hidden.shape[1])
        tg = jnp.pad(targets, (0, pad)).reshape(-1, rows)
        out = jax.lax.map(lambda a: _score_rows(cfg, k, params, *a), (h, tg))
        return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:])[:t], out)
    return _score_rows(cfg, k, params, hidden, targets)


def _score_rows(cfg: ModelConfig, k: int, params, hidden, targets):
    """`_score_fn` on rows hidden [R, E], targets i32[R] at once."""
    logits = compute_logits(cfg, params, hidden)  # f32[R, V]
    lse = jax.nn.logsumexp(logits, axis=-1)  # [T_pad]
    tgt = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0] - lse
    if k == 0:
        t = logits.shape[0]
        return tgt, jnp.zeros((t, 0), jnp.int32), jnp.zeros((t, 0), jnp.float32)
    top_l, top_i = jax.lax.top_k(logits, k)
    return tgt, top_i.astype(jnp.int32), top_l - lse[:, None]


def _head_fn(cfg: ModelConfig, max_logprobs: int, logprobs_mode: str, params, rows,
             sampling: SamplingMetadata):
    """Head program (one per S_pad): LM head over the first S_pad of the gathered rows
    [S_max, E] (S_pad is the sampling metadata's leading size), then the sampler.
    Returns (`SamplerOutput`, its token ids padded with zeros to i32[S_max]): the next
    step's placeholder rows read theirs from the latter on the device, whatever this
    step's S_pad (`merge_placeholders`)."""
    s_pad = jax.tree.leaves(sampling)[0].shape[0]
    res = sample(compute_logits(cfg, params, rows[:s_pad]), sampling, max_logprobs=max_logprobs,
                 logprobs_mode=logprobs_mode)
    return res, jnp.pad(res.token_ids, (0, rows.shape[0] - s_pad))


def merge_placeholders(input_ids, src, prev_ids):
    """A step's input ids i32[T] with each placeholder replaced on the device by the token
    the step before sampled: position t takes prev_ids[src[t]] (prev_ids i32[S_max], the
    head's padded ids) where src[t] >= 0, else keeps input_ids[t] (async scheduling with
    output placeholders, issue 24; vLLM V1 fills its input batch's ids the same way)."""
    return jnp.where(src >= 0, prev_ids[jnp.maximum(src, 0)], input_ids)
