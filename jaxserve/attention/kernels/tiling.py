"""Tile arithmetic and the sliding-window scalar shared by the attention kernels."""

import jax
import jax.numpy as jnp

# The window of a layer that has none: more keys than any sequence holds (i32-safe).
NO_WINDOW = 1 << 30


def window_scalar(sliding_window: "jax.Array | int | None") -> "jax.Array":
    """i32[] the keys a query sees (itself included): `sliding_window`, or NO_WINDOW for
    None. Data, not a static argument: one program serves local and global layers."""
    if sliding_window is None:
        return jnp.int32(NO_WINDOW)
    return jnp.asarray(sliding_window, jnp.int32).reshape(())


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1): the query-head group G = H / K
    is padded to it so a tile's rows are block_q * next_pow2(G)."""
    return 1 << max(0, int(x) - 1).bit_length()
