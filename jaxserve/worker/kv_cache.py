"""KV pool sizing: bytes per block, the number of blocks a config or a memory budget
gives, and the one-line capacity summary the engine logs."""

from __future__ import annotations

import jax.numpy as jnp

from jaxserve.config import EngineConfig, ModelConfig, max_blocks_per_seq


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, kv_dtype: str | None = None) -> int:
    """Bytes of K plus V for one block across all layers, in `kv_dtype` (a dtype name,
    `EngineConfig.kv_dtype`; None: the model's dtype)."""
    itemsize = jnp.dtype(kv_dtype or cfg.dtype).itemsize
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * itemsize


def resolve_num_kv_blocks(config: EngineConfig) -> int:
    """`num_kv_blocks` from the config, or from the KV memory budget.

    Raises:
      ValueError: the budget cannot hold even one `max_model_len` sequence.
    """
    cache = config.cache
    per_block = kv_bytes_per_block(config.model, cache.block_size, config.kv_dtype)
    need = max_blocks_per_seq(config.scheduler.max_model_len, cache.block_size) + 1  # + null
    n = cache.num_kv_blocks
    if n is None:
        n = cache.kv_cache_memory_bytes // per_block
        if n < need:
            raise ValueError(
                f"kv_cache_memory_bytes={cache.kv_cache_memory_bytes} holds {n} blocks of "
                f"{per_block} bytes; one max_model_len={config.scheduler.max_model_len} sequence "
                f"needs {need} (raise the budget or lower max_model_len)")
    return int(n)


def describe_capacity(config: EngineConfig, num_kv_blocks: int) -> str:
    """One line: KV capacity in blocks, tokens and max_model_len sequences."""
    tokens = (num_kv_blocks - 1) * config.cache.block_size
    seqs = tokens / config.scheduler.max_model_len
    mib = num_kv_blocks * kv_bytes_per_block(config.model, config.cache.block_size,
                                             config.kv_dtype) / 2**20
    return (f"KV cache: {num_kv_blocks} blocks x {config.cache.block_size} tokens = {tokens} tokens "
            f"({mib:.1f} MiB), {config.kv_dtype}, {seqs:.1f} concurrent sequences of max_model_len="
            f"{config.scheduler.max_model_len}")
