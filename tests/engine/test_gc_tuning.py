"""`jaxserve.engine.stats.tune_gc`: the young-generation threshold `freeze_gc_heap` sets."""

from __future__ import annotations

import gc

from jaxserve.engine.stats import GC_YOUNG_THRESHOLD, tune_gc


def test_tune_gc_raises_the_young_threshold_and_keeps_the_rest():
    saved = gc.get_threshold()
    try:
        gc.set_threshold(700, 11, 12)
        tune_gc()
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, 11, 12)
        gc.set_threshold(10 * GC_YOUNG_THRESHOLD, 3, 4)  # a higher one is the user's: kept
        tune_gc()
        assert gc.get_threshold() == (10 * GC_YOUNG_THRESHOLD, 3, 4)
        gc.set_threshold(0, 10, 10)  # 0: automatic collection off, left off
        tune_gc()
        assert gc.get_threshold()[0] == 0
    finally:
        gc.set_threshold(*saved)
