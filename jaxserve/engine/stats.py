"""`LLMEngine.get_stats`: the engine's counters and gauges in one dict (metrics endpoints,
benchmark summaries)."""

from __future__ import annotations

from typing import Any


def engine_stats(engine: Any) -> dict[str, Any]:
    """Counters and gauges of an `LLMEngine` (its scheduler, KV pool, runner, buckets)."""
    kv = engine.scheduler.kv_cache_manager
    rs = engine.runner.stats()
    return {
        "num_running": engine.scheduler.num_running,
        "num_waiting": engine.scheduler.num_waiting,
        "kv_cache_usage": kv.usage,
        "num_free_blocks": kv.num_free_blocks,
        "num_total_blocks": kv.num_blocks,
        "num_preemptions": engine.scheduler.num_preemptions,
        "num_aborted": engine.num_aborted,
        "num_failed_steps": engine.num_failed_steps,
        "prompt_tokens_total": engine.prompt_tokens_total,
        "generation_tokens_total": engine.outputs.generation_tokens_total,
        "prefix_cache_queries": kv.prefix_cache_queries,
        "prefix_cache_hits": kv.prefix_cache_hits,
        # {T_pad: {"steps", "real_tokens", "padded_tokens", "padding_fraction"}}
        "bucket_stats": engine.bucket_policy.stats()["token_buckets"],
        "num_steps": rs.num_steps,
        "warmup_programs": rs.warmup_programs,
        "warmup_seconds": rs.warmup_seconds,
        "num_compiles_after_warmup": rs.late_compiles,
        "num_compiles": rs.programs_built,  # compiled by XLA (persistent-cache misses)
        "num_programs_loaded": rs.programs_loaded,  # persistent compile-cache hits
        "num_programs_restored": rs.programs_restored,  # executable-cache hits (no trace)
        "programs_ready": rs.programs_ready,  # of warmup_programs (progressive warm-up)
        "warmup_done": rs.warmup_done,
        "compile_seconds": rs.compile_seconds,
        "last_step_tokens": engine.last_step_tokens,
        "weight_version": engine.weight_version,
        "paused": engine.pauser.paused,
        "pause_mode": engine.pauser.mode,
        **engine.sleeper.stats(),  # is_sleeping, sleep_level, device bytes held
    }


_heap_frozen = False

# The young generation's threshold after `freeze_gc_heap` (CPython's default: 700 net
# allocations). A serving step allocates a few objects a row that die by the next step
# (outputs, row records): at 256 rows that is > 700 live at once, so the default ran a
# young collection ~4 times a step, each promoting the step's live outputs, and a full
# collection of every request's state every ~30 steps. 50 000 (freqtrade's and Instagram's
# setting) lets them die by reference count first: `jaxserve bench host` at 256 rows ran
# no collection at all in its window, and 13% less host time a step (BUILD_NOTES, issue 24).
# Cyclic garbage is still collected, every 50 000 net allocations.
GC_YOUNG_THRESHOLD = 50_000


def tune_gc() -> None:
    """Raise the cyclic GC's young-generation threshold to `GC_YOUNG_THRESHOLD` (never
    lowers a higher one; the older generations' thresholds are kept)."""
    import gc

    t0, t1, t2 = gc.get_threshold()
    if t0 and t0 < GC_YOUNG_THRESHOLD:
        gc.set_threshold(GC_YOUNG_THRESHOLD, t1, t2)


def freeze_gc_heap() -> bool:
    """Move every object alive now out of the cyclic GC's reach (`gc.collect()` then
    `gc.freeze()`) and collect the young generation less often (`tune_gc`), once per
    process; True if this call froze it.

    What vLLM does after warm-up (`freeze_gc_heap`) and SGLang offers (`freeze_gc`): the
    startup heap (jax, the modules, the tokenizer, the weights' Python objects) is hundreds
    of thousands of objects that every full collection would walk again, while a step
    allocates a few short-lived objects per row; measured on `jaxserve bench host` at 256
    rows, the host's work per step fell ~20-35% (BUILD_NOTES, issue 24). Frozen objects are
    still freed by reference counting; only cyclic garbage among them stays (`gc.unfreeze()`
    undoes it). Once per process, so a process that builds many engines (tests, sweeps)
    freezes only the first one's heap.
    """
    global _heap_frozen
    if _heap_frozen:
        return False
    import gc

    gc.collect()
    gc.freeze()
    tune_gc()
    _heap_frozen = True
    return True
