"""Buckets: padding never truncates, warm-up covers exactly the reachable shapes,
fitted buckets are optimal (vs brute force) and beat pow2 on skewed traffic (C24)."""

import itertools
import random

import pytest

from jaxserve.config import SchedulerConfig
from jaxserve.scheduler.buckets import (BucketPolicy, expected_padded_tokens, fit_buckets,
                                        pow2_buckets, pow2_linear_buckets)

BUDGETS = [1, 2, 3, 16, 17, 100, 317, 512]


def test_builders_by_hand():
    assert pow2_buckets(317, 8) == (8, 16, 32, 64, 128, 256, 317)
    assert pow2_buckets(512, 8) == (8, 16, 32, 64, 128, 256, 512)
    assert pow2_buckets(1) == (1,)
    assert pow2_buckets(3, 8) == (3,)
    assert pow2_buckets(6) == (1, 2, 4, 6)
    assert pow2_linear_buckets(317, 64, 8) == (8, 16, 32, 64, 128, 192, 256, 317)
    assert pow2_linear_buckets(320, 64, 8) == (8, 16, 32, 64, 128, 192, 256, 320)
    assert pow2_linear_buckets(100, 48, 4) == (4, 8, 16, 32, 48, 96, 100)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("builder", ["pow2", "pow2_linear"])
def test_budget_buckets_monotonic_cover_and_end_at_budget(budget, builder):
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=min(6, budget),
                          bucket_policy=builder, bucket_gap=16, min_token_bucket=8)
    pol = BucketPolicy.from_config(cfg)
    assert pol.token_buckets[-1] == budget and pol.seq_buckets[-1] == min(6, budget)
    warm = set(pol.all_shapes())
    prev = 0
    for n in range(1, budget + 1):
        t = pol.pad_tokens(n)
        assert n <= t <= budget and t in pol.token_buckets and t >= prev  # monotonic
        prev = t
        for s in range(1, min(n, pol.max_num_seqs) + 1):
            assert pol.pad(n, s) in warm  # drawn from the warm-up set
    with pytest.raises(ValueError, match=f"num_tokens={budget + 1}.*{budget}"):
        pol.pad(budget + 1, 1)
    with pytest.raises(ValueError, match="num_tokens=0"):
        pol.pad_tokens(0)


@pytest.mark.parametrize("tb,sb", [((8, 16, 32), (1, 2, 4, 32)), ((1, 2, 3), (1, 2, 3)),
                                   ((4, 100), (8, 16)), ((16, 17, 100), (1, 6))])
def test_all_shapes_is_exactly_the_reachable_set(tb, sb):
    pol = BucketPolicy(tb, sb)
    reach = {pol.pad(t, s) for t in range(1, tb[-1] + 1) for s in range(1, min(t, sb[-1]) + 1)}
    assert set(pol.all_shapes()) == reach
    assert len(pol.all_shapes()) == len(reach)  # no duplicates


def test_pad_errors_and_validation():
    pol = BucketPolicy([4, 8], [2, 4])
    with pytest.raises(ValueError, match="num_seqs=5 exceeds num_tokens=4"):
        pol.pad(4, 5)
    with pytest.raises(ValueError, match="num_seqs=5 .*largest seq bucket=4"):
        pol.pad(8, 5)
    for bad in ([], [4, 4], [8, 4], [0, 4], [2.5]):
        with pytest.raises(ValueError):
            BucketPolicy(bad, [1])
    with pytest.raises(ValueError):
        pow2_buckets(0)
    with pytest.raises(ValueError):
        pow2_linear_buckets(64, 0)


def test_counters():
    pol = BucketPolicy([4, 8], [1, 2])
    pol.record(3, 1)
    pol.record(4, 2)
    pol.record(5, 2)
    st = pol.stats()
    assert st["token_buckets"][4] == {"steps": 2, "real_tokens": 7, "padded_tokens": 8,
                                      "padding_fraction": pytest.approx(1 / 8)}
    assert st["token_buckets"][8]["padded_tokens"] == 8 and st["token_buckets"][8]["real_tokens"] == 5
    assert st["seq_buckets"] == {1: 1, 2: 2}
    assert st["steps"] == 3 and st["real_tokens"] == 12 and st["padded_tokens"] == 16
    assert st["padding_fraction"] == pytest.approx(0.25)
    pol.reset_stats()
    assert pol.stats()["steps"] == 0


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
