"""A GGUF file's quantized matrices kept as blocks (issue 26): the parameter tree of
`load_model(..., quantization=...)` for a GGUF file.

Q8_0, Q4_0 and Q4_1 tensors become `jaxserve.model.quant.QuantizedWeight`s straight from
the file's bytes (f16 scales as stored; Q4_0's d * (q - 8) as scale d, min -8 d);
nothing is dequantized to float. Other quantized types (Q5_0/Q5_1, the K-quants) are
dequantized and requantized to Q8_0 blocks (more bits than they had: never fewer).
F32/F16/BF16 matrices stay float, so the engine's scheme (`quant.engine_scheme`)
decides what they become. Norms and biases are always float32.
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from jaxserve.checkpoint.gguf_loader import (GGUF_ARCHS, GGUF_LAYER_NAMES, GGUF_TOP_NAMES,
                                             dequantize_tensor, open_gguf)
from jaxserve.checkpoint.layout import (MATRIX_LEAVES, CheckpointError, TensorSource,
                                        check_tree, unpermute_qk)
from jaxserve.config import ModelConfig
from jaxserve.model.params import empty_aligned, param_shapes
from jaxserve.model.quant import QuantizedWeight, quantize_q8

_FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
_BLOCK_BYTES = {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20}


def blocks_of(t: Any, path: Path) -> QuantizedWeight | None:
    """A GGUF matrix as blocks: Q8_0 / Q4_0 / Q4_1 as stored, another quantized type
    requantized to Q8_0 blocks, None for a float tensor. Shape [N, K] (ggml ne reversed).

    Raises:
      CheckpointError: an unsupported type (via `dequantize_tensor`).
    """
    qtype = Q(int(t.tensor_type))
    if qtype in _FLOAT_TYPES:
        return None
    n, k = (int(x) for x in reversed(t.shape.tolist()))
    if qtype not in _BLOCK_BYTES:
        return quantize_q8(dequantize_tensor(t, path))
    raw = np.asarray(t.data, np.uint8).reshape(n, k // 32, _BLOCK_BYTES[qtype])
    d = np.ascontiguousarray(raw[..., :2]).view(np.float16)[..., 0]
    if qtype == Q.Q8_0:
        q = np.ascontiguousarray(raw[..., 2:]).view(np.int8).reshape(n, k)
        return QuantizedWeight(q, d, None, "q8", 32)
    if qtype == Q.Q4_0:  # -8 d is exact in f16 (a power of two) unless it overflows
        q, mn = raw[..., 2:], (np.float32(-8) * d.astype(np.float32)).astype(np.float16)
        if not np.all(np.isfinite(mn) | ~np.isfinite(d)):
            raise CheckpointError(f"{path}: tensor '{t.name}': a Q4_0 scale above 8191 "
                                  "cannot be kept as Q4_1 blocks; use quantization='none'")
    else:
        mn = np.ascontiguousarray(raw[..., 2:4]).view(np.float16)[..., 0]
        q = raw[..., 4:]
    return QuantizedWeight(np.ascontiguousarray(q).reshape(n, k // 2), d, mn, "q4", 32)


def has_blocks(path: Path) -> bool:
    """Whether a GGUF file holds any quantized (non-F32/F16/BF16) tensor (reads the
    header's tensor infos, memory-mapped; no tensor data)."""
    return any(Q(int(t.tensor_type)) not in _FLOAT_TYPES for t in open_gguf(path).tensors)


def _unpermute(w: QuantizedWeight, n_head: int) -> QuantizedWeight:
    """llama.cpp's Q/K row permutation undone on blocks: rows (outputs) move whole."""
    return w.map(lambda a: np.ascontiguousarray(unpermute_qk(a, n_head)))


def _fill_layers(get: Callable[[int], Any], n: int, path: Path, leaf: str) -> Any:
    """Layers 0..n-1 of one leaf (`get(i)`: a `QuantizedWeight` or a float array) stacked
    into [L, ...] arrays allocated once (64-byte aligned, so CPU `device_put` can take them
    in place) and filled layer by layer, so the load holds one layer's temporaries, not
    all L layers beside their `np.stack`.

    Raises:
      CheckpointError: the layers mix float and quantized tensors, or differ in format
        or shape.
    """
    first = get(0)
    quantized = isinstance(first, QuantizedWeight)
    parts = (lambda w: (w.q, w.scale, w.min)) if quantized else (lambda a: (a,))
    def fmt(w: Any) -> tuple:  # what every layer must share: kind, block, shape, dtypes
        head = (w.kind, w.block) if quantized else ()
        return (*head, tuple(w.shape), *(None if a is None else str(a.dtype) for a in parts(w)))
    out = [None if a is None else empty_aligned((n, *a.shape), a.dtype) for a in parts(first)]
    for i in range(n):
        w = first if i == 0 else get(i)
        if isinstance(w, QuantizedWeight) != quantized:
            raise CheckpointError(f"{path}: layers of '{leaf}' mix float and quantized "
                                  "tensors; load it with quantization='none'")
        if fmt(w) != fmt(first):
            raise CheckpointError(f"{path}: '{leaf}': layer {i} is {fmt(w)}, layer 0 is "
                                  f"{fmt(first)}; layers of one leaf must share a format")
        for o, a in zip(out, parts(w)):
            if o is not None:
                o[i] = a
    return QuantizedWeight(out[0], out[1], out[2], first.kind, first.block) if quantized \
        else out[0]


def drop_file_pages(reader: gguf.GGUFReader) -> None:
    """Drop the GGUF memory map's pages from this process's resident set (madvise
    MADV_DONTNEED on a read-only shared map: a later read faults them back in from the
    page cache). Called after each leaf is copied out: the file's bytes then never sit in
    RSS beside the whole converted tree (~97 MB for SmolLM2's Q4_1 file). A no-op where
    the reader's data is not a read-only memory map (`open_gguf`'s is): on a copy-on-write
    map it would throw away the writes."""
    base = reader.data
    while base is not None and not isinstance(base, np.memmap):
        base = getattr(base, "base", None)
    mm = getattr(base, "_mmap", None)
    if isinstance(mm, mmap.mmap) and base.mode == "r" and hasattr(mmap, "MADV_DONTNEED"):
        mm.madvise(mmap.MADV_DONTNEED)


def load_gguf_blocks(reader: gguf.GGUFReader, cfg: ModelConfig, path: Path) -> dict:
    """The canonical tree with the file's quantized matrices kept as blocks (see the
    module docstring); float matrices [in, out] as `load_gguf_params` gives them.

    Raises:
      CheckpointError: missing / unexpected tensors, wrong shapes, unsupported types,
        or layers of one leaf quantized in different formats.
    """
    by_name = {t.name: t for t in reader.tensors}
    arch = reader.fields["general.architecture"].contents()
    permuted = GGUF_ARCHS[arch][1]

    def convert(t: Any) -> Any:
        qw = blocks_of(t, path)
        return dequantize_tensor(t, path) if qw is None else qw

    src = TensorSource(by_name, path, convert)

    def matrix(name: str, *, embed: bool = False, n_head: int = 0) -> Any:
        a = src.take(name)
        if isinstance(a, QuantizedWeight):
            return _unpermute(a, n_head) if n_head else a
        a = unpermute_qk(a, n_head) if n_head else a
        return a if embed else np.ascontiguousarray(a.T)  # [out, in] -> [in, out]

    heads = {"wq": cfg.num_attention_heads, "wk": cfg.num_key_value_heads}
    layers: dict[str, Any] = {}
    for leaf in param_shapes(cfg)["layers"]:
        name = GGUF_LAYER_NAMES[leaf]
        if leaf in MATRIX_LEAVES:
            n_head = heads.get(leaf, 0) if permuted else 0
            layers[leaf] = _fill_layers(lambda i, name=name, n_head=n_head:
                                        matrix(name.format(i=i), n_head=n_head),
                                        cfg.num_hidden_layers, path, leaf)
        else:
            layers[leaf] = _fill_layers(lambda i, name=name: src.take(name.format(i=i)),
                                        cfg.num_hidden_layers, path, leaf)
        drop_file_pages(reader)
    params = {"embed": matrix(GGUF_TOP_NAMES["embed"], embed=True), "layers": layers,
              "final_norm": src.take(GGUF_TOP_NAMES["final_norm"])}
    if not cfg.tie_word_embeddings:
        head = src.take(GGUF_TOP_NAMES["lm_head"])  # [V, E]: quantized stays [N, K]
        params["lm_head"] = head if isinstance(head, QuantizedWeight) else \
            np.ascontiguousarray(head.T)
    drop_file_pages(reader)
    extra = sorted(set(by_name) - src.used)
    if extra:
        raise CheckpointError(f"{path}: unexpected tensors for a {arch} GGUF: {extra[:8]}")
    check_tree(cfg, params, path)
    return params
