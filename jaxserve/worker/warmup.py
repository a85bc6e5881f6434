"""Warm-up: build every program a runner's bucket policy can ask for, before serving.

It drives a `jaxserve.worker.compile.ProgramTable` (`build(key)`, `key in table`)
and never the runner itself, as JetStream's warm-up drives its engine API. Each
program is lowered on an all-padding batch (every token writes to the null block,
no sequence is real), which has exactly the shapes and pytree structure of a real
step.

Progressive mode (issue 12): `run` returns once stage 0 of
`BucketPolicy.program_stages()` is ready and builds the rest on a daemon thread,
publishing the largest ready token bucket as the policy's `token_cap` so the
scheduler never plans a step whose program is missing.
The cap is data: the runner exposes it (`token_cap`) and the engine passes it to
`Scheduler.schedule(token_cap)`; nothing here writes another layer's state.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import threading
import time
import weakref
from typing import Any

from tqdm.auto import tqdm

from jaxserve.scheduler.buckets import BucketPolicy
from jaxserve.worker.compile import ProgramKey, ProgramTable

logger = logging.getLogger(__name__)

# Progressive warm-up is ready once every token bucket up to this many tokens is built
# (`BucketPolicy.program_stages(ready_tokens=)`): with the default buckets from 1 token,
# a 1-token cap would prefill a prompt one token a step until the next stages compile.
READY_TOKENS = 8

_WARMING: "weakref.WeakSet[Warmup]" = weakref.WeakSet()


@atexit.register
def _stop_background_warmups() -> None:
    """At exit, let an in-flight background compile finish (XLA aborts the process when
    the interpreter is torn down under a compiling thread); later programs are skipped."""
    for w in list(_WARMING):
        w.close(timeout=None)


class Warmup:
    """Builds a `ProgramTable`'s warm-up set, in full or progressively.

    Args:
      table: the programs to build (and their accounting, `table.stats`).
      bucket_policy: the shapes (`program_stages`).
      compile_threads: programs built at once before ready (XLA:CPU compiles one
        program on one core).
      score: include the score programs (`enable_prompt_logprobs`).
    """

    def __init__(self, table: ProgramTable, bucket_policy: BucketPolicy, *,
                 compile_threads: int, score: bool):
        self.table = table
        self.bucket_policy = bucket_policy
        self.compile_threads = compile_threads
        self.score = score
        self._done = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # The largest token bucket whose programs are ready (None: all, or not warming).
        # One int store, read once per step by the engine's thread.
        self.token_cap: int | None = None

    def run(self, *, progress: bool = True, mode: str = "full") -> None:
        """Build (or restore / load) every program the bucket policy can request
        (`BucketPolicy.program_keys()`: T_pad stacks + S_pad heads, and T_pad score
        programs with `score`).

        mode:
          "full": returns once every program is ready.
          "progressive": returns once stage 0 of `BucketPolicy.program_stages()` is
            ready (the programs of every token bucket up to `READY_TOKENS` = 8 tokens and
            the seq-bucket programs a step of that many tokens can need)
            with `token_cap` at that bucket; a daemon thread builds the
            larger token buckets in order and raises the cap as each one is ready (a
            step never waits for a compile). Warm-up ends when the last program is
            ready (`wait`, `stats.warmup_done`); `strict_compiles` still refuses any
            program outside the warm-up set.

        Raises:
          ValueError: an unknown mode.
        """
        if mode not in ("full", "progressive"):
            raise ValueError(f"warmup mode={mode!r} must be 'full' or 'progressive'")
        stages = self.stages()
        total = sum(len(keys) for _, keys in stages)
        st = self.table.stats
        st.warmup_programs = total
        counts0 = (st.programs_built, st.programs_loaded, st.programs_restored)
        t0 = time.perf_counter()
        now = stages if mode == "full" or len(stages) == 1 else stages[:1]
        bar = tqdm(total=sum(len(k) for _, k in now), desc="warm-up (compile buckets)",
                   disable=not progress)
        for cap, keys in now:
            self._build_all(keys, bar)
            self.token_cap = cap
        bar.close()
        st.ready_seconds = time.perf_counter() - t0
        self.table.serving = True
        rest = stages[len(now):]
        if not rest:
            self._finish(t0, counts0)
            return
        logger.info("ready with %d of %d programs in %.1f s (steps capped at %d tokens); "
                    "compiling the other %d in the background", st.programs_ready, total,
                    st.ready_seconds, self.token_cap,
                    total - st.programs_ready)
        self._thread = threading.Thread(target=self._background, args=(rest, t0, counts0),
                                        name="jaxserve-warmup", daemon=True)
        _WARMING.add(self)
        self._thread.start()

    def stages(self) -> list[tuple[int, list[ProgramKey]]]:
        """[(token_cap, keys)]: the warm-up set in build order
        (`BucketPolicy.program_stages` with the score family and `READY_TOKENS`)."""
        return self.bucket_policy.program_stages(score=self.score, ready_tokens=READY_TOKENS)

    def keys(self) -> list[ProgramKey]:
        """Every program `run` builds, in order (a deviceless compile builds these too)."""
        return [k for _, keys in self.stages() for k in keys]

    def _build_all(self, keys: list[ProgramKey], bar: Any) -> None:
        """Build the missing ones of `keys` on `compile_threads` threads, ticking `bar`."""
        todo = [k for k in keys if k not in self.table]
        bar.update(len(keys) - len(todo))
        n = min(self.compile_threads, len(todo))
        if n <= 1:
            for key in todo:
                self.table.build(key)
                bar.update(1)
            return
        with concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="jaxserve-compile") as ex:
            futures = [ex.submit(self.table.build, key) for key in todo]
            try:
                for f in concurrent.futures.as_completed(futures):
                    f.result()  # the first failure raises here ...
                    bar.update(1)
            except BaseException:
                ex.shutdown(cancel_futures=True)  # ... and the queued builds are dropped
                raise

    def _background(self, stages, t0: float, counts0: tuple[int, int, int]) -> None:
        try:
            for cap, keys in stages:
                for key in keys:
                    if self._stop.is_set():
                        return
                    if key not in self.table:
                        self.table.build(key)
                self.token_cap = cap  # ints: one atomic store, read per step
            self._finish(t0, counts0)
        except Exception:  # noqa: BLE001 - serving goes on at the cap reached so far
            logger.exception("background warm-up failed; steps stay capped at %d tokens",
                             self.token_cap)
        finally:  # stopped (close), failed or done: wait() never hangs
            self._done.set()

    def _finish(self, t0: float, counts0: tuple[int, int, int]) -> None:
        st = self.table.stats
        self.token_cap = None  # every bucket is ready
        st.warmup_seconds = time.perf_counter() - t0
        st.warmup_done = True
        self._done.set()
        built, loaded, restored = (st.programs_built - counts0[0], st.programs_loaded - counts0[1],
                                   st.programs_restored - counts0[2])
        logger.info("warm-up: %d programs in %.1f s (%d compiled by XLA, %d loaded from the "
                    "compile cache, %d restored from the executable cache)", st.warmup_programs,
                    st.warmup_seconds, built, loaded, restored)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the last program is ready (or warm-up failed); True if all are."""
        self._done.wait(timeout)
        return self.table.stats.warmup_done

    def close(self, timeout: float | None = 60.0) -> None:
        """Stop a background warm-up after the program it is building (joins the thread)."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
