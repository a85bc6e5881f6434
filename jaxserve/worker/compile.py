"""Compile accounting: each AOT program is built by XLA, loaded from JAX's persistent
compile cache, or restored from the executable cache, and counted as such.

`ProgramTable` holds a runner's programs keyed by (family, size) and is the narrow
API that warm-up (`jaxserve.worker.warmup`) drives: `build(key)`, `key in table`,
`get(key)` (a missing program after warm-up is a counted late compile, or refused
with `strict_compiles`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import jax

from jaxserve.worker.executable_cache import ExecutableCache
from jaxserve.worker.runner import RunnerStats

logger = logging.getLogger(__name__)

ProgramKey = tuple[str, int]  # ("stack" | "head" | "score", bucket size)


class CacheHits:
    """Persistent compile-cache hits seen by the calling thread (a `jax.monitoring` listener).

    jax records '/jax/compilation_cache/cache_hits' in the thread that asked
    for the executable, so a per-thread count read around one `.compile()`
    says exactly whether that program was loaded rather than built, even
    while another thread compiles.
    """

    _EVENT = "/jax/compilation_cache/cache_hits"
    _local = threading.local()
    _lock = threading.Lock()
    _installed = False

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if not cls._installed:
                jax.monitoring.register_event_listener(cls._on_event)
                cls._installed = True

    @classmethod
    def _on_event(cls, event: str, **kw: Any) -> None:
        if event == cls._EVENT:
            cls._local.n = cls.count() + 1

    @classmethod
    def count(cls) -> int:
        return getattr(cls._local, "n", 0)


def enable_compilation_cache(cache_dir: str | None) -> None:
    """Turn on JAX's persistent compilation cache in `cache_dir` (None: leave off).

    Thresholds are lowered to zero so that even the small CPU programs are
    cached: a restart then skips XLA compilation entirely.
    """
    if not cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", str(cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    from jaxserve.testing import faults  # crash-safety tests: die mid-write when JAXSERVE_FAULT says so

    faults.arm_compile_cache()


def aot_compile(fn: Any, args: tuple, *, exec_cache: ExecutableCache | None,
                key_parts: dict | None) -> tuple[Any, str]:
    """(program, how) of `fn` lowered on `args`: "restored" from `exec_cache` under
    `key_parts` (no trace), else lowered and compiled: "built" by XLA or "loaded" from
    JAX's persistent compile cache.

    Every program is checked against `args` (structure, shapes, dtypes) before it is
    returned or stored: a full `make test` twice got another program's executable back
    from a compile racing the warm-up's other compile thread (a stack program for a head
    key, and the reverse), which would run the wrong computation. A mismatch is logged
    and rebuilt; a third mismatch raises.

    Raises:
      RuntimeError: three compiles in a row gave a program that does not take `args`.
    """
    hits0 = CacheHits.count()
    if exec_cache is not None:
        program = exec_cache.load(key_parts)
        if program is not None:
            if takes(program, args):
                return program, "restored"
            logger.warning("executable cache entry for %s does not take the program's "
                           "arguments; rebuilding it", _name(key_parts))
    for attempt in range(3):
        program = fn.lower(*args).compile()
        if takes(program, args):
            break
        logger.warning("compiling %s returned a program for other arguments (attempt %d); "
                       "compiling again", _name(key_parts), attempt + 1)
    else:
        raise RuntimeError(f"compiling {_name(key_parts)} kept returning a program for other "
                           f"arguments")
    kind = "loaded" if CacheHits.count() > hits0 else "built"
    # Only a fresh XLA compile is stored: on XLA:CPU an executable that came out of
    # JAX's compile cache re-serializes without its JIT-compiled kernels and fails
    # at run time ("Function wrapped_iota not found"). It is stored once a compile
    # is real (`make clean-cache`, or a cold compile-cache dir).
    if exec_cache is not None and kind == "built":
        exec_cache.store(key_parts, program)
    return program, kind


def _name(key_parts: dict | None) -> str:
    return "a program" if not key_parts else f"program {key_parts['family']} {key_parts['size']}"


def takes(program: Any, args: tuple) -> bool:
    """Whether a compiled program's inputs are `args`: the same pytree structure and each
    leaf's shape and (canonical) dtype."""
    try:
        if program.in_tree != jax.tree.structure((tuple(args), {})):
            return False
        got = jax.tree.leaves(program.args_info)
        want = jax.tree.leaves(tuple(args))
        return len(got) == len(want) and all(
            tuple(g.shape) == tuple(w.shape)
            and g.dtype == jax.dtypes.canonicalize_dtype(w.dtype) for g, w in zip(got, want))
    except Exception:  # noqa: BLE001 - a program without the introspection: not checkable
        return True


class ProgramTable:
    """A runner's AOT programs by `ProgramKey`, with their accounting in `stats`.

    Args:
      make: key -> (program, how), how in {"built", "loaded", "restored"}; called
        from the warm-up threads too, so it must be thread-safe.
      stats: the runner's `RunnerStats` (compile seconds, counts, late compiles).
      strict: after `serving` is set, refuse a missing program instead of compiling it.
    """

    def __init__(self, make: Callable[[ProgramKey], tuple[Any, str]], stats: RunnerStats, *,
                 strict: bool):
        self.make = make
        self.stats = stats
        self.strict = strict
        self.serving = False  # warm-up handed over: a missing program is a late compile
        self.programs: dict[ProgramKey, Any] = {}
        self.lock = threading.Lock()  # the background warm-up thread builds too

    def __contains__(self, key: ProgramKey) -> bool:
        return key in self.programs

    def of_family(self, family: str) -> list[Any]:
        """The programs of one family built so far."""
        with self.lock:
            return [p for (f, _), p in self.programs.items() if f == family]

    def build(self, key: ProgramKey) -> Any:
        """Make one program ready and count it (thread-safe)."""
        t0 = time.perf_counter()
        program, kind = self.make(key)
        with self.lock:
            st = self.stats
            dt = time.perf_counter() - t0
            st.compile_seconds += dt
            st.compile_seconds_by_family[key[0]] = st.compile_seconds_by_family.get(key[0], 0.) + dt
            if kind == "restored":
                st.programs_restored += 1
            elif kind == "loaded":
                st.programs_loaded += 1
            else:
                st.programs_built += 1
            self.programs[key] = program
            st.programs_ready = len(self.programs)
        return program

    def get(self, key: ProgramKey) -> Any:
        """The program for `key`, built now if warm-up did not (a counted late compile).

        Raises:
          RuntimeError: with `strict`, a key warm-up did not build.
        """
        program = self.programs.get(key)
        if program is not None:
            return program
        if self.serving:
            with self.lock:
                self.stats.late_compiles += 1
            if self.strict:
                raise RuntimeError(f"no {key[0]} program for bucket {key[1]}: warm-up built "
                                   f"{sorted(self.programs)} (strict_compiles)")
            logger.error("late compile: no warm-up %s program for bucket %d; a shape escaped "
                         "BucketPolicy.program_keys() or the progressive warm-up cap "
                         "(%d late so far)", key[0], key[1], self.stats.late_compiles)
        return self.build(key)
