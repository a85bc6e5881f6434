"""Offline bucket fitting: choose token/sequence buckets for an observed workload.

A tools-side optimiser (used by `jaxserve bench buckets` and
scripts/bench_scheduler.py), not part of the serving path: the scheduler only
pads with whatever buckets it is given (`jaxserve.scheduler.buckets`).
`fit_buckets` is an exact dynamic programme that picks k buckets minimising
the expected padded token count of a tokens-per-step histogram.
"""

from __future__ import annotations

import bisect
from typing import Mapping, Sequence

import numpy as np

from jaxserve.scheduler.buckets import check_positive_int


def fit_buckets(histogram: Mapping[int, int], k: int, max_size: int) -> tuple[int, ...]:
    """The k buckets minimising expected padded tokens for a tokens-per-step histogram.

    Exact: an optimal bucket set can always be moved down onto observed counts
    (a bucket above the largest count it covers only adds padding), so the
    search is over the sorted distinct counts plus max_size, which is always
    included so that no count can exceed the largest bucket. Dynamic
    programme over (buckets used, last bucket): O(k * m^2) with NumPy
    vectorised over the inner minimum, m = distinct counts.

    Args:
      histogram: tokens-per-step -> number of steps (counts >= 0).
      k: number of buckets wanted (>= 1); fewer are returned when there are
        fewer distinct counts.
      max_size: the largest bucket (= max_num_batched_tokens).

    Returns: strictly increasing bucket sizes, the last == max_size.

    Raises:
      ValueError: k < 1, a key outside [1, max_size], or a negative count.
    """
    check_positive_int("k", k)
    check_positive_int("max_size", max_size)
    weights: dict[int, float] = {}
    for n, c in histogram.items():
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= max_size:
            raise ValueError(f"histogram key {n!r} must be an int in [1, max_size={max_size}]")
        if c < 0:
            raise ValueError(f"histogram count {c!r} for {n} tokens must be >= 0")
        weights[int(n)] = weights.get(int(n), 0) + float(c)
    weights.setdefault(int(max_size), 0.0)
    vals = np.array(sorted(weights), dtype=np.float64)  # [m]
    w = np.array([weights[int(v)] for v in vals])  # [m]
    m = len(vals)
    k = min(k, m)
    cum = np.concatenate([[0.0], np.cumsum(w)])  # cum[j] = weight of vals[:j]
    # best[j] = min cost covering vals[:j+1] with the last bucket at vals[j].
    best = vals * cum[1:]  # one bucket
    parents = []
    for _ in range(1, k):
        # cost[i, j] = best[i] + vals[j] * (cum[j+1] - cum[i+1]) for i < j.
        cost = best[:, None] + vals[None, :] * (cum[None, 1:] - cum[1:, None])  # [m, m]
        cost[np.tril_indices(m)] = np.inf
        arg = np.argmin(cost, axis=0)  # [m]
        new = cost[arg, np.arange(m)]
        parents.append(arg)
        best = new
    # Walk back from the forced last bucket (max_size = vals[-1]).
    j = m - 1
    out = [j]
    for arg in reversed(parents):
        j = int(arg[j])
        out.append(j)
    return tuple(int(vals[i]) for i in sorted(out))


def expected_padded_tokens(histogram: Mapping[int, int], buckets: Sequence[int]) -> int:
    """Sum over steps of the padded size (what `fit_buckets` minimises).

    Raises:
      ValueError: a count above the largest bucket.
    """
    b = sorted(buckets)
    total = 0
    for n, c in histogram.items():
        i = bisect.bisect_left(b, n)
        if i == len(b):
            raise ValueError(f"{n} tokens exceed the largest bucket {b[-1]}")
        total += b[i] * c
    return total
