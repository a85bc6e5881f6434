"""Fused projections: the matrices that read the same input, concatenated along the output
axis (wq|wk|wv -> wqkv, w_gate|w_up -> w_gate_up), so a layer runs four matmuls instead
of seven. It is the usual layout of vLLM (`QKVParallelLinear`, `MergedColumnParallelLinear`)
and llama.cpp's fused QKV; jaxserve applies it where it measures faster (issue 26: block-
quantized weights on CPU, where each native matmul call has a fixed cost;
notes/issue26.md, "seventh session"), through `EngineConfig.fuse_projections`.

Float leaves are canonical [.., E, N] and concatenate on their last axis; a
`QuantizedWeight` is stored [.., N, K] and concatenates its blocks, scales and minimums on
axis -2 (rows of whole blocks: the block format along K is untouched, so the fused
matrix's products are bit-identical to the separate ones', column block by column block).
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model.params import empty_aligned
from jaxserve.model.quant import QuantizedWeight

# fused key -> the canonical keys it concatenates, in output order
FUSED = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}
FUSED_BIAS = ("bqkv", ("bq", "bk", "bv"))


def _cat(parts: list[Any], axis: int) -> Any:
    if any(isinstance(p, jax.Array) for p in parts):
        return jnp.concatenate(parts, axis=axis)
    parts = [np.asarray(p) for p in parts]
    shape = list(parts[0].shape)
    shape[axis] = sum(p.shape[axis] for p in parts)
    # 64-byte aligned, so that CPU `device_put` takes the fused leaf in place (a NumPy
    # allocation is 16-byte aligned, and JAX would copy it once more)
    return np.concatenate(parts, axis=axis, out=empty_aligned(tuple(shape),
                                                              np.result_type(*parts)))


def concat_outputs(parts: list[Any], *, key: str) -> Any:
    """`parts` (float [.., E, N_i] or QuantizedWeight [.., N_i, K]) as one matrix over the
    concatenated output axis.

    Raises:
      ValueError: the parts mix float and quantized leaves, or quantized formats (kind or
        block) that differ, naming `key` and the formats.
    """
    quantized = [isinstance(p, QuantizedWeight) for p in parts]
    if not any(quantized):
        return _cat(parts, -1)
    formats = {(p.kind, p.block) if isinstance(p, QuantizedWeight) else ("float", None)
               for p in parts}
    if len(formats) > 1:
        raise ValueError(f"fuse_projections: {key}'s parts have different formats "
                         f"{sorted(formats, key=str)}; fusing needs one")
    q = parts[0]
    return QuantizedWeight(_cat([p.q for p in parts], -2), _cat([p.scale for p in parts], -2),
                           None if q.min is None else _cat([p.min for p in parts], -2),
                           q.kind, q.block)


def fuse_projections(lp: Mapping[str, Any], *, attention_bias: bool) -> dict[str, Any]:
    """One layer's (or the stacked layers') engine leaves with the fused keys in place of
    their parts (`FUSED`; with `attention_bias` also bq|bk|bv -> bqkv). NumPy in -> NumPy
    out, jax in -> jax out (a new buffer either way).

    Raises:
      ValueError: from `concat_outputs` (parts of different formats).
    """
    lp = dict(lp)
    for fused, parts in FUSED.items():
        lp[fused] = concat_outputs([lp.pop(k) for k in parts], key=fused)
    if attention_bias:
        fused, parts = FUSED_BIAS
        lp[fused] = _cat([lp.pop(k) for k in parts], -1)
    return lp


def fusable(layers: Mapping[str, Any]) -> bool:
    """Whether every group of `FUSED` parts in the canonical (stacked) layer leaves is
    block-quantized in one format: the layout `fuse_projections=None` (auto) fuses."""
    for parts in FUSED.values():
        leaves = [layers[k] for k in parts]
        if not all(isinstance(w, QuantizedWeight) for w in leaves):
            return False
        if len({(w.kind, w.block) for w in leaves}) > 1:
            return False
    return True


def is_fused(layer: Mapping[str, Any]) -> bool:
    """Whether an engine layer dict holds the fused layout."""
    return "wqkv" in layer


def unfused_like(layer: Mapping[str, Any]) -> dict[str, Any]:
    """A fused engine layer's leaves keyed by the canonical names they were made of (each
    part mapped to its fused leaf: what `update_params` quantizes a float part like)."""
    out = dict(layer)
    for fused, parts in (*FUSED.items(), FUSED_BIAS):
        if fused in out:
            leaf = out.pop(fused)
            out.update(dict.fromkeys(parts, leaf))
    return out


def resolve_fuse(config: Any, platform: str) -> bool | None:
    """`EngineConfig.fuse_projections` of `config` for a runner on `platform`: True / False
    as set; None (auto) stays None ("fuse if `fusable`", decided by `prepare_params` once
    the weights' formats are known) on CPU with no LoRA, one device and a Llama block, and
    is False elsewhere.

    Raises:
      ValueError: True together with LoRA slots, tensor parallelism or the Gemma 3 block
        (none of them has a fused layout), naming what is on.
    """
    setting = config.fuse_projections
    blockers = [name for name, on in (
        (f"max_loras={config.max_loras}", config.max_loras > 0),
        (f"tensor_parallel_size={config.tensor_parallel_size}", config.tensor_parallel_size > 1),
        ("the Gemma 3 block", config.model.sandwich_norms)) if on]
    if setting is True and blockers:
        raise ValueError(f"fuse_projections=True is not supported with {', '.join(blockers)}")
    if setting is None and (blockers or platform != "cpu"):
        return False
    return setting
