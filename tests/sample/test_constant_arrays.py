"""`constant_array`'s shared read-only arrays (kept on the device by `put_batch`) are told
apart from a step's own arrays by identity; an id must never pass to another object."""

from __future__ import annotations

import gc
import threading

import numpy as np

from jaxserve.sample import metadata


def test_a_racing_duplicate_never_lends_its_id_to_a_batch_array():
    """Two threads missing lru_cache's entry at once both build the array and only one is
    cached; the other (what `__wrapped__` returns here) used to die with its id still
    registered, so a later array at that address passed for a constant (and `put_batch`
    swapped in a stale device copy)."""
    dup = metadata.constant_array.__wrapped__((3, 5), 7, "int32")
    assert metadata.is_constant_array(dup)
    dead = id(dup)
    del dup
    gc.collect()
    fresh = [np.zeros((3, 5), np.int32) for _ in range(2000)]  # same size: same allocations
    assert not any(metadata.is_constant_array(a) for a in fresh)
    assert dead not in {id(a) for a in fresh}


def test_constant_arrays_from_threads_are_shared_and_recognised():
    got: list[np.ndarray] = []
    ts = [threading.Thread(target=lambda: got.append(metadata.constant_array((4, 6), -1, "int32")))
          for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert all(metadata.is_constant_array(a) and not a.flags.writeable for a in got)
    assert all(np.array_equal(a, np.full((4, 6), -1, np.int32)) for a in got)
    assert not metadata.is_constant_array(np.full((4, 6), -1, np.int32))
