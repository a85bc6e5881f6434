"""Free and restore a `ModelRunner`'s device memory between rollout phases (issue 28).

vLLM's `sleep(level)` / `wake_up(tags)` and SGLang's `release_memory_occupation` /
`resume_memory_occupation`, for a trainer that shares the device with the engine:

- level 1 frees the KV cache's buffers (its contents are dropped: the engine only
  sleeps with no request holding KV, and forgets the prefix cache);
- level 2 also moves the weights to host memory (NumPy copies), or drops them when the
  caller will send new ones (`discard_weights=True`, then `update_params` before waking).

Freed leaves become `jax.ShapeDtypeStruct`s with the live buffer's shape, dtype and
sharding, so `ModelRunner.update_params` validates a new tree against them unchanged
and wake-up places new buffers exactly as before: the ahead-of-time programs take them
as they are, nothing is recompiled. On CPU the freed pages are handed back to the OS
(`malloc_trim`): XLA's CPU buffers come from malloc, which otherwise keeps them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
from typing import Any

import jax
import numpy as np

logger = logging.getLogger(__name__)

SLEEP_LEVELS = (1, 2)
SLEEP_TAGS = ("weights", "kv_cache")  # vLLM's wake_up tags


def spec_bytes(tree: Any) -> int:
    """Bytes of every array (or ShapeDtypeStruct) leaf of `tree`, global shapes."""
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def release(tree: Any) -> Any:
    """Delete every device buffer of `tree`; return placeholders (ShapeDtypeStruct with
    the buffer's shape, dtype and sharding) in its structure."""
    def free(a: Any) -> Any:
        spec = jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
        a.delete()
        return spec
    return jax.tree.map(free, tree)


def return_freed_memory() -> None:
    """On the CPU backend, give the pages malloc kept back to the OS (glibc `malloc_trim`)."""
    if jax.default_backend() != "cpu":
        return
    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS falls when malloc decides
        logger.debug("malloc_trim unavailable (%s); freed KV pages stay with malloc", name)


class RunnerSleep:
    """The sleep state of one `ModelRunner` (it calls `sleep` / `wake_up` here).

    Args:
      runner: the `ModelRunner`; this reads and replaces its `params` and `kv_cache`
        and rebuilds the cache with its `_zero_kv_cache()`.
    """

    def __init__(self, runner: Any):
        self.runner = runner
        self.host_params: Any = None  # level 2: the weights' NumPy copies
        self.kv_bytes = spec_bytes(runner.kv_cache)
        self.weights_bytes = spec_bytes(runner.params)
        self.kv_on_device = self.weights_on_device = True

    def params_sent(self) -> None:
        """`update_params` placed new weights: they are on the device, a host copy is stale."""
        self.weights_on_device, self.host_params = True, None

    @property
    def is_sleeping(self) -> bool:
        return not (self.kv_on_device and self.weights_on_device)

    def sleep(self, level: int, *, discard_weights: bool = False) -> None:
        """Free the KV cache (level 1) and the weights (level 2; kept on the host unless
        `discard_weights`). The caller makes sure no request holds KV.

        Raises:
          ValueError: a level not in SLEEP_LEVELS, discard_weights below level 2, already
            asleep, or a multi-host run (the followers would keep their buffers).
        """
        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level={level!r} must be 1 (free the KV cache) or 2 "
                             "(also move the weights off the device)")
        if discard_weights and level != 2:
            raise ValueError(f"discard_weights=True needs level=2, got level={level}")
        if self.is_sleeping:
            raise ValueError("sleep: the runner is already asleep")
        if jax.process_count() > 1:
            raise ValueError(f"sleep is not supported across {jax.process_count()} processes "
                             "(multi-host)")
        r = self.runner
        if level == 2:
            if not discard_weights:  # copies: a CPU device buffer may alias host memory
                self.host_params = jax.tree.map(lambda a: np.array(a, copy=True), r.params)
            r.params = release(r.params)
            self.weights_on_device = False
        r.kv_cache = release(r.kv_cache)
        self.kv_on_device = False
        return_freed_memory()

    def wake_up(self, tags: tuple[str, ...] = SLEEP_TAGS) -> None:
        """Bring back what `tags` names (a subset of SLEEP_TAGS): "weights" from the host
        copy (unless `update_params` already sent new ones), "kv_cache" as a zeroed pool.

        Raises:
          ValueError: an unknown tag, or the weights were discarded and none were sent.
        """
        bad = [t for t in tags if t not in SLEEP_TAGS]
        if bad:
            raise ValueError(f"wake_up tags {bad} are unknown; expected a subset of {SLEEP_TAGS}")
        r = self.runner
        if "weights" in tags and not self.weights_on_device:
            if self.host_params is None:
                raise ValueError("wake_up: the weights were discarded at sleep(level=2, "
                                 "discard_weights=True); send new ones with update_params first")
            r.params = jax.tree.map(lambda h, s: jax.device_put(h, s.sharding),
                                    self.host_params, r.params)
            self.params_sent()
        if "kv_cache" in tags and not self.kv_on_device:
            r.kv_cache = r._zero_kv_cache()
            self.kv_on_device = True

    def memory(self) -> dict[str, Any]:
        """{"kv_cache_bytes", "weights_bytes"}: device bytes held now (global shapes);
        "weights": "device", "host" or "discarded"."""
        w = ("device" if self.weights_on_device else
             "host" if self.host_params is not None else "discarded")
        return {"kv_cache_bytes": self.kv_bytes if self.kv_on_device else 0,
                "weights_bytes": self.weights_bytes if w == "device" else 0, "weights": w}
