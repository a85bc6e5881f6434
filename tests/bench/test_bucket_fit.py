"""The offline bucket fitter: optimal (vs brute force) and better than pow2 on skewed traffic."""

import itertools
import random

import pytest

from jaxserve.bench.bucket_fit import expected_padded_tokens, fit_buckets
from jaxserve.scheduler.buckets import pow2_buckets


def _brute(hist, k, max_size):
    vals = sorted(set(hist) | {max_size})
    best = None
    for r in range(1, min(k, len(vals)) + 1):
        for comb in itertools.combinations(vals[:-1], r - 1):
            b = tuple(comb) + (max_size,)
            c = expected_padded_tokens(hist, b)
            if best is None or c < best:
                best = c
    return best


@pytest.mark.parametrize("seed", range(25))
def test_fit_buckets_matches_brute_force(seed):
    rng = random.Random(seed)
    max_size = rng.choice([8, 20, 33, 64])
    hist = {rng.randint(1, max_size): rng.randint(0, 50) for _ in range(rng.randint(1, 9))}
    k = rng.randint(1, 5)
    b = fit_buckets(hist, k, max_size)
    assert b[-1] == max_size and list(b) == sorted(set(b)) and len(b) <= k
    assert expected_padded_tokens(hist, b) == _brute(hist, k, max_size)


def test_fitted_beats_pow2_on_skewed_histogram():
    # Mostly small decode batches (3..9 tokens) plus a few full prefill steps.
    hist = {3: 400, 5: 300, 9: 250, 12: 100, 40: 20, 130: 10, 256: 5}
    p2 = pow2_buckets(256, 8)  # 6 buckets
    fit = fit_buckets(hist, len(p2), 256)
    assert len(fit) == len(p2)
    assert expected_padded_tokens(hist, fit) < expected_padded_tokens(hist, p2)
    assert expected_padded_tokens(hist, fit) == _brute(hist, 6, 256)
    # By hand: pow2 costs 8*700 + 16*350 + 64*20 + 256*15 = 16320; the optimum keeps 3 and 5
    # exact, merges 9 into 12 and drops 256-padding of the 130-token steps:
    # 3*400 + 5*300 + 12*350 + 40*20 + 130*10 + 256*5 = 10280.
    assert expected_padded_tokens(hist, p2) == 16320
    assert fit == (3, 5, 12, 40, 130, 256) and expected_padded_tokens(hist, fit) == 10280


def test_fit_buckets_validation():
    with pytest.raises(ValueError, match="histogram key 300"):
        fit_buckets({300: 1}, 2, 256)
    with pytest.raises(ValueError, match="k=0"):
        fit_buckets({3: 1}, 0, 256)
    with pytest.raises(ValueError, match="count -1"):
        fit_buckets({3: -1}, 2, 256)
    assert fit_buckets({}, 3, 16) == (16,)
