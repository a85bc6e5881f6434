"""Public entry points: `load_model` and `load_tokenizer` (GGUF file or HF directory)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from jaxserve.checkpoint import cache
from jaxserve.checkpoint.default import DEFAULT_PARAMS_CACHE_DIR, resolve_model_path
from jaxserve.checkpoint.gguf_loader import load_gguf_params, read_gguf_header
from jaxserve.checkpoint.gguf_quant import has_blocks, load_gguf_blocks
from jaxserve.checkpoint.hf import load_hf_config, load_hf_params
from jaxserve.checkpoint.layout import CheckpointError
from jaxserve.checkpoint.tokenizer import Tokenizer
from jaxserve.config import ModelConfig, platform_dtype
from jaxserve.model.llama import cast_params
from jaxserve.model.quant import resolve_scheme, tree_kinds

log = logging.getLogger(__name__)
_DTYPES = ("float32", "bfloat16")


def _kind(path: Path) -> str:
    if path.is_dir():
        return "hf"
    if path.suffix == ".gguf":
        return "gguf"
    raise CheckpointError(f"{path}: expected a .gguf file or an HF checkpoint directory")


def load_tokenizer(path: str | Path | None = None, *,
                   cache_dir: str | Path | None = DEFAULT_PARAMS_CACHE_DIR) -> Tokenizer:
    """The tokenizer of a checkpoint (GGUF metadata or the HF dir's tokenizer.json).

    Taken from a params-cache entry of the same source when one exists (parsing
    SmolLM2's GGUF metadata costs ~4 s); never writes the cache.

    Args:
      path: .gguf file or HF dir; None = the default model (checkpoints/SmolLM2-...gguf).
      cache_dir: params cache root to look in, or None.
    Raises:
      FileNotFoundError: the path (or the default model: run `make model`) is missing.
      CheckpointError (a ValueError): the tokenizer cannot be built; names the file.
    """
    p = resolve_model_path(path)
    kind = _kind(p)
    if cache_dir is not None and Path(cache_dir).is_dir():
        tok = cache.restore_tokenizer(Path(cache_dir), p)
        if tok is not None:
            return tok
    if kind == "gguf":
        return read_gguf_header(p)[2]
    return Tokenizer.from_hf_dir(p)


def _convert(p: Path, dtype: str, progress: bool) -> tuple[ModelConfig, dict, Tokenizer]:
    """Parse and convert a checkpoint (no cache): float32 conversion, then cast to dtype."""
    if _kind(p) == "gguf":
        reader, cfg, tok = read_gguf_header(p, dtype=dtype)
        params = load_gguf_params(reader, cfg, p, progress=progress)
    else:
        cfg = load_hf_config(p, dtype=dtype)
        tok = Tokenizer.from_hf_dir(p)
        if tok.vocab_size > cfg.vocab_size:
            raise CheckpointError(f"{p}: tokenizer has {tok.vocab_size} ids but the model "
                                  f"vocab_size is only {cfg.vocab_size}")
        params = load_hf_params(p, cfg, progress=progress)
    return cfg, cast_params(params, dtype), tok


def load_model(path: str | Path | None = None, *, dtype: str | None = None,
               cache_dir: str | Path | None = DEFAULT_PARAMS_CACHE_DIR,
               progress: bool = True, quantization: str | None = None
               ) -> tuple[ModelConfig, dict, Tokenizer]:
    """Load (config, params, tokenizer) from a .gguf file or an HF checkpoint directory.

    Params are the jaxserve tree of host NumPy arrays (see `jaxserve.checkpoint.layout`),
    dequantized to float32 and then cast to `dtype` (bfloat16 via ml_dtypes); the
    caller device_puts them. The result is cached (one .npy per leaf, see
    `jaxserve.checkpoint.cache`) under `cache_dir/<sha256(source)[:16]>-<dtype>-npy1/`;
    a later load of the same content memory-maps it (copy-on-write) instead of
    parsing and converting again. `cache_dir=None` disables it.

    Args:
      path: .gguf file or HF dir; None = the default model.
      dtype: "float32" | "bfloat16" (parameter dtype, also set as `cfg.dtype`); None:
        the platform's (`jaxserve.config.platform_dtype`: bf16 on GPU/TPU, f32 on CPU).
      cache_dir: params cache root (default checkpoints/params_cache) or None.
      progress: show a tqdm bar per tensor during conversion.
      quantization: None (default) or "none": the full-precision tree above. Another
        scheme ("auto" | "int8" | "q8_0" | "q4", `EngineConfig.quantization`): a GGUF
        file's quantized matrices come as `jaxserve.model.quant.QuantizedWeight` blocks read
        straight from the file (`gguf_quant.load_gguf_blocks`, not cached); a GGUF with
        no quantized tensor, and an HF checkpoint, load as with None (cached), float: the engine quantizes those where it places the
        weights (`prepare_params`), so no full-precision copy of a quantized file is made.
    Raises:
      FileNotFoundError: missing path (the default model's message says `make model`).
      CheckpointError (a ValueError): corrupt/truncated file, unsupported architecture or
        quantization type, missing/extra/misshaped tensors; the message names the file.
      ValueError: dtype not in ("float32", "bfloat16"); an unknown quantization, or "q4"
        of a quantized file with no 4-bit tensors (never requantized to fewer bits).
    """
    dtype = dtype or platform_dtype()
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of {_DTYPES}")
    p = resolve_model_path(path)
    if quantization not in (None, "none") and _kind(p) == "gguf" and has_blocks(p):
        return _load_blocks(p, dtype, quantization)
    if quantization is not None:
        resolve_scheme(quantization, kept_kinds=set(), source=str(p))
    _kind(p)
    t0 = time.perf_counter()
    entry = None if cache_dir is None else cache.entry_dir(Path(cache_dir), p, dtype)
    hit = None if entry is None else cache.restore(entry)
    if hit is not None:
        log.info("restored %s from cache %s in %.2f s", p, entry, time.perf_counter() - t0)
        return hit
    cfg, params, tok = _convert(p, dtype, progress)
    if entry is not None:
        cache.save(entry, cfg, params, tok)
    log.info("converted %s in %.2f s", p, time.perf_counter() - t0)
    return cfg, params, tok


def _load_blocks(p: Path, dtype: str, quantization: str) -> tuple[ModelConfig, dict, Tokenizer]:
    """A GGUF file with its quantized matrices kept as blocks (checked against the scheme)."""
    t0 = time.perf_counter()
    reader, cfg, tok = read_gguf_header(p, dtype=dtype)
    params = cast_params(load_gguf_blocks(reader, cfg, p), dtype)
    resolve_scheme(quantization, kept_kinds=tree_kinds(params), source=str(p))
    log.info("read %s as blocks in %.2f s", p, time.perf_counter() - t0)
    return cfg, params, tok
