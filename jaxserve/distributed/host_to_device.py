"""A step's host batch onto the device in one call into jaxlib (issue 24: host work per step).

`TensorParallel.put_batch` sends each step's ~20-27 small NumPy arrays (token ids,
positions, attention and sampling metadata). `jax.device_put` on such a tree spends ~30 us
of Python a leaf (0.76-0.81 ms for 22 leaves on this 2-core CPU); the C++ loop it ends in,
jaxlib's `shard_args`, takes ~4 us a leaf (~0.1 ms) called once for all of them. vLLM's
V1 model runner likewise copies its persistent input buffers with one non-blocking copy
per buffer, not per request.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

try:  # jaxlib's batched host-to-device copy (what `jax.device_put` calls per leaf)
    from jax._src.lib import _jax as _jaxlib
    _SHARD_ARGS, _ALWAYS_COPY = _jaxlib.shard_args, _jaxlib.ArrayCopySemantics.ALWAYS_COPY
except (ImportError, AttributeError):  # another jaxlib: `jax.device_put` serves
    _SHARD_ARGS = _ALWAYS_COPY = None
_FAST_DTYPES = frozenset(np.dtype(t) for t in (np.int32, np.uint32, np.float32, np.bool_,
                                               np.int8, np.uint8, np.int16, np.float16))


def copy_leaves_to_device(host: Any, sharding: Any) -> Any | None:
    """A host batch's NumPy leaves copied onto `sharding` in ONE call into jaxlib
    (`shard_args`, the C++ loop under `jax.device_put`), jax.Array leaves kept as they
    are; None where that path does not apply (no such jaxlib function, a leaf of another
    type or of a 64-bit dtype, which `jax.device_put` would canonicalize, a jax.Array
    leaf placed elsewhere, or a default device set in JAX's config).

    The arrays are committed to `sharding` (`jax.device_put(x)` without a target gives
    uncommitted ones on the default device). Each leaf is first copied on the host: on CPU
    jaxlib keeps a 64-byte-aligned NumPy array as the device buffer even under its
    ALWAYS_COPY semantics (as `jax.device_put` does), so without the copy a host that
    reused its arrays would change a step in flight; with it the host may reuse them at
    once (tests/distributed/test_host_to_device.py).

    `jax.device_put` on a step's ~20-27 small leaves costs ~30 us a leaf of Python here;
    this path ~8 with the host copies (issue 24: 0.83-0.91 ms -> 0.18 ms for a one-row
    step's 27 leaves, 22 of them NumPy, one process, this CPU)."""
    if _SHARD_ARGS is None or jax.config.jax_default_device is not None:
        return None
    leaves, treedef = jax.tree.flatten(host)
    idx = [i for i, x in enumerate(leaves) if not isinstance(x, jax.Array)]
    if len(idx) < len(leaves) and any(isinstance(x, jax.Array) and x.sharding != sharding
                                      for x in leaves):
        return None
    if not all(type(leaves[i]) is np.ndarray and leaves[i].dtype in _FAST_DTYPES for i in idx):
        return None
    n = len(idx)
    out = list(leaves)
    if n:
        placed = _SHARD_ARGS([sharding] * n, [None] * n, [_ALWAYS_COPY] * n,
                             [np.array(leaves[i], copy=True) for i in idx], fallback=None)
        for i, x in zip(idx, placed):
            out[i] = x
    return jax.tree.unflatten(treedef, out)
