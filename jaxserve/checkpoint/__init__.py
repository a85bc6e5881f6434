"""Checkpoint loading: HF safetensors dirs, llama.cpp GGUF files, a memory-mapped params cache,
the tokenizer wrapper and the default model (SmolLM2-135M-Instruct Q4_1).

Public API:
  load_model(path=None, *, dtype=None (the platform's: f32 on CPU), cache_dir=..., progress=True)
      -> (ModelConfig, params tree of NumPy arrays, Tokenizer)
  load_tokenizer(path=None) -> Tokenizer
  resolve_model_path(path=None) -> Path;  DEFAULT_MODEL_PATH
  CheckpointError (ValueError subclass; the message names the file and the problem)
"""

from typing import Any

from jaxserve.checkpoint.default import DEFAULT_MODEL_PATH, resolve_model_path
from jaxserve.checkpoint.errors import CheckpointError
from jaxserve.checkpoint.tokenizer import Tokenizer

__all__ = ["CheckpointError", "DEFAULT_MODEL_PATH", "Tokenizer", "load_model", "load_tokenizer",
           "resolve_model_path"]


def __getattr__(name: str) -> Any:
    """`load_model` / `load_tokenizer` on first use (PEP 562): the loader imports jax, and a
    process that only reads a pickled `Tokenizer` (the server's API process with
    `--engine_process`) must not pay for it (~180 MiB)."""
    if name in ("load_model", "load_tokenizer"):
        from jaxserve.checkpoint import loader

        return getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
