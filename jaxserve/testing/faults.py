"""Fault injection for crash-safety tests: the process SIGKILLs itself at a named point.

`JAXSERVE_FAULT=name[,name...]` arms the points; unset (the default) every
point is a no-op costing one dict lookup. SIGKILL rather than an exception,
because a real crash (OOM killer, `kill -9`, power loss) runs no `finally`,
no atexit and no flush: whatever is half-written stays half-written, which is
exactly what the next start must survive.

Points:
  params_cache_write   inside `checkpoint.cache.save`, after the .npy leaves
                       are written to the temporary entry, before meta.json.
  params_cache_rename  inside `checkpoint.cache.save`, with the temporary entry
                       complete, just before it is renamed into place.
  params_cache_pause   not a crash: `checkpoint.cache.save` sleeps 3 s after the
                       .npy leaves are written, so a test's SIGKILL from outside
                       lands mid-write (a tiny model's save is over in a
                       millisecond, too fast to catch by polling).
  compile_cache_write  inside JAX's persistent compilation-cache write: half of
                       the executable's bytes are written to the final file
                       (JAX's `LRUCache.put` writes in place, not atomically),
                       then the process dies. Armed by `arm_compile_cache`.
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)
ENV = "JAXSERVE_FAULT"
POINTS = ("params_cache_write", "params_cache_rename", "params_cache_pause",
          "compile_cache_write")


def armed(name: str) -> bool:
    """True when `name` is listed in $JAXSERVE_FAULT.

    Raises:
      ValueError: $JAXSERVE_FAULT names a point that does not exist (a typo
        would otherwise make a crash test pass vacuously).
    """
    names = [n.strip() for n in os.environ.get(ENV, "").split(",") if n.strip()]
    unknown = [n for n in names if n not in POINTS]
    if unknown:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: unknown fault point {unknown[0]!r}; "
                         f"known: {POINTS}")
    return name in names


def crash_point(name: str) -> None:
    """SIGKILL this process now if `name` is armed (see the module docstring)."""
    if armed(name):
        log.error("fault injection: killing pid %d at %s", os.getpid(), name)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)


def pause_point(name: str, seconds: float = 3.0) -> None:
    """Sleep `seconds` here if `name` is armed (a window for an outside kill)."""
    if armed(name):
        import time

        log.warning("fault injection: pausing %.1f s at %s", seconds, name)
        time.sleep(seconds)


def arm_compile_cache() -> None:
    """Make JAX's compilation-cache write die half-way when `compile_cache_write` is armed.

    Wraps `jax._src.lru_cache.LRUCache.put` (JAX's file cache; private API, so
    this is only touched when the fault is armed): the wrapper writes the first
    half of the value to the entry's final path and then SIGKILLs the process,
    leaving the truncated file a crash mid-write leaves.
    """
    if not armed("compile_cache_write"):
        return
    from jax._src import lru_cache

    def put(self, key: str, value: bytes) -> None:
        path = self.path / f"{key}{lru_cache._CACHE_SUFFIX}"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(value[:len(value) // 2])
            f.flush()
            os.fsync(f.fileno())
        crash_point("compile_cache_write")

    lru_cache.LRUCache.put = put
