"""Tile arithmetic shared by the Pallas kernels (Triton and Mosaic GPU)."""


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1): the query-head group G = H / K
    is padded to it so a tile's rows are block_q * next_pow2(G)."""
    return 1 << max(0, int(x) - 1).bit_length()
