"""Buckets: padding never truncates and warm-up covers exactly the reachable shapes (C24).
(The offline fitter's tests are in tests/bench/test_bucket_fit.py.)"""

import pytest

from jaxserve.config import SchedulerConfig
from jaxserve.scheduler.buckets import BucketPolicy, pow2_buckets, pow2_linear_buckets

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
    # Per program family (the runner's warm-up set): stacks per T_pad, heads per S_pad.
    keys = pol.program_keys()
    assert len(keys) == len(set(keys))
    assert {k for f, k in keys if f == "stack"} == {t for t, _ in reach}
    assert {k for f, k in keys if f == "head"} == {s for _, s in reach}
    assert {f for f, _ in keys} == {"stack", "head"}
    # With scoring on (prompt logprobs / LLM.score), one score program per reachable T_pad:
    # a step with a scoring row can have any token count.
    skeys = pol.program_keys(score=True)
    assert skeys[:len(keys)] == keys and len(skeys) == len(set(skeys))
    assert {k for f, k in skeys if f == "score"} == {t for t, _ in reach}
    assert {f for f, _ in skeys} == {"stack", "head", "score"}


def test_program_keys_by_hand():
    # (4, 100) x (8, 16): T=4 cannot hold 8 rows but T=100 can hold 16, so both heads are
    # reachable; (1, 2) x (1, 4, 8): S=8 needs S_prev + 1 = 5 tokens, more than T_max = 2.
    assert BucketPolicy((4, 100), (8, 16)).program_keys() == [
        ("stack", 4), ("stack", 100), ("head", 8), ("head", 16)]
    assert BucketPolicy((1, 2), (1, 4, 8)).program_keys() == [
        ("stack", 1), ("stack", 2), ("head", 1), ("head", 4)]  # 8 needs >= 5 tokens
    assert BucketPolicy((4, 100), (8, 16)).program_keys(score=True) == [
        ("stack", 4), ("stack", 100), ("head", 8), ("head", 16), ("score", 4), ("score", 100)]


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
