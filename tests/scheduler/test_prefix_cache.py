"""Prefix caching: exact block multiples (C06), multi-turn reuse, n>1 siblings,
LRU eviction, counters, and no shared block ever written twice."""

import pytest

from jaxserve.worker.fake_runner import FakeRunner

from ._util import assert_pool_clean, expected_tokens, make_req, make_scheduler, prompt

B = 4


def _first_row(steps, rid):
    for st in steps:
        for r in st.out.scheduled:
            if r.request_id == rid:
                return r
    raise AssertionError(rid)


def _run(s, reqs, steps):
    for r in reqs:
        s.add_request(r)
    return FakeRunner(s, check_invariants=True, on_step=steps.append).run()


@pytest.mark.parametrize("k", [1, 3, 5])
def test_prompt_of_exactly_k_blocks_sent_twice(k):
    s = make_scheduler(block_size=B, num_kv_blocks=40)
    p = prompt(k * B, 1)
    steps = []
    d1 = _run(s, [make_req("one", p, max_tokens=5)], steps)
    d2 = _run(s, [make_req("two", p, max_tokens=5)], steps)
    one, two = _first_row(steps, "one"), _first_row(steps, "two")
    # Full hit would leave nothing to compute: the last block is recomputed instead.
    assert two.start_pos == (k - 1) * B and two.token_ids == tuple(p[(k - 1) * B:])
    assert two.block_ids[:k - 1] == one.block_ids[:k - 1]
    assert two.block_ids[k - 1] != one.block_ids[k - 1] and two.sample
    assert d2["two"].output_token_ids == expected_tokens("two", 5)
    kv = s.kv_cache_manager
    assert kv.prefix_cache_queries == 2 * k * B and kv.prefix_cache_hits == (k - 1) * B
    assert d1["one"].output_token_ids == expected_tokens("one", 5)
    assert_pool_clean(s)


def test_partial_last_block_hits_all_full_blocks():
    s = make_scheduler(block_size=B, num_kv_blocks=40)
    p = prompt(3 * B + 3, 2)
    steps = []
    _run(s, [make_req("one", p, max_tokens=2)], steps)
    _run(s, [make_req("two", p + [5, 6], max_tokens=2)], steps)
    two = _first_row(steps, "two")
    assert two.start_pos == 3 * B and two.token_ids == tuple((p + [5, 6])[3 * B:])


def test_multi_turn_reuses_prompt_and_generated_blocks():
    s = make_scheduler(block_size=B, num_kv_blocks=60)
    p1 = prompt(10, 3)
    steps = []
    d = _run(s, [make_req("t1", p1, max_tokens=9)], steps)
    out1 = d["t1"].output_token_ids
    # Turn 1 computed positions 0..17 (the last output is never fed): 4 full blocks.
    p2 = p1 + out1 + prompt(6, 4)
    d = _run(s, [make_req("t2", p2, max_tokens=4)], steps)
    t2 = _first_row(steps, "t2")
    assert t2.start_pos == 16 and t2.token_ids == tuple(p2[16:])
    assert d["t2"].output_token_ids == expected_tokens("t2", 4)
    assert_pool_clean(s)


def test_siblings_share_prompt_blocks():
    s = make_scheduler(budget=64, block_size=B, num_kv_blocks=40)
    p = prompt(22, 6)  # 5 full blocks + 2 tokens
    for i in range(3):
        s.add_request(make_req(f"x#{i}", p, max_tokens=6))
    steps = []
    fr = FakeRunner(s, check_invariants=True, on_step=steps.append)
    first = fr.step().out
    # Sibling 0 computes the prompt; 1 and 2 wait one step to hit its blocks instead.
    assert [r.request_id for r in first.scheduled] == ["x#0"]
    second = fr.step().out
    rows = {r.request_id: r for r in second.scheduled}
    kv = s.kv_cache_manager
    for i in (1, 2):
        r = rows[f"x#{i}"]
        assert r.start_pos == 20 and r.token_ids == tuple(p[20:])
        assert r.block_ids[:5] == first.scheduled[0].block_ids[:5]
    for b in first.scheduled[0].block_ids[:5]:
        assert kv.ref_count(b) == 3
    done = fr.run()
    for i in range(3):
        assert done[f"x#{i}"].output_token_ids == expected_tokens(f"x#{i}", 6)
    assert_pool_clean(s)


def test_lru_eviction_order_and_counters():
    # 12 usable blocks. "a" and "c" each leave 3 cached full blocks behind.
    s = make_scheduler(block_size=B, num_kv_blocks=13, budget=64)
    pa, pc = prompt(13, 7), prompt(13, 8)
    steps = []
    _run(s, [make_req("a", pa, max_tokens=1)], steps)
    _run(s, [make_req("c", pc, max_tokens=1)], steps)
    kv = s.kv_cache_manager
    assert kv.num_cached_blocks == 6 and kv.num_free_blocks == 12
    # "big" needs 10 fresh blocks: the 6 uncached ones first, then a's 3 cached
    # blocks (freed earliest), then c's tail block (a prefix's tail goes before its head).
    _run(s, [make_req("big", prompt(37, 9), max_tokens=1)], steps)
    assert kv.num_evictions == 4
    assert kv.get_computed_blocks(make_req("probe_a", pa))[1] == 0
    assert kv.get_computed_blocks(make_req("probe_c", pc))[1] == 8
    steps2 = []
    _run(s, [make_req("c2", pc, max_tokens=1)], steps2)
    assert _first_row(steps2, "c2").start_pos == 8
    assert kv.prefix_cache_queries == 3 * 13 + 37 and kv.prefix_cache_hits == 8
    assert_pool_clean(s)


def test_caching_disabled_never_hits():
    s = make_scheduler(block_size=B, num_kv_blocks=40, prefix=False)
    p = prompt(16, 1)
    steps = []
    _run(s, [make_req("one", p, max_tokens=3)], steps)
    _run(s, [make_req("two", p, max_tokens=3)], steps)
    assert _first_row(steps, "two").start_pos == 0
    assert s.kv_cache_manager.num_cached_blocks == 0 and s.kv_cache_manager.prefix_cache_hits == 0


def test_written_blocks_are_never_shared():
    # Many requests with common prefixes under pressure; every written block is exclusive.
    s = make_scheduler(budget=24, max_seqs=6, block_size=B, num_kv_blocks=30, threshold=10)
    base = prompt(12, 1)
    for i in range(10):
        s.add_request(make_req(f"r{i}", base[: 4 + i] + prompt(i % 3 + 1, i), max_tokens=8))
    kv = s.kv_cache_manager

    def check(st):
        written = set()
        for r in st.out.scheduled:
            lo, hi = r.start_pos // B, (r.end_pos - 1) // B
            for b in r.block_ids[lo:hi + 1]:
                assert b not in written
                written.add(b)
    done = FakeRunner(s, check_invariants=True, on_step=check).run()
    assert len(done) == 10 and kv.prefix_cache_hits > 0
    assert_pool_clean(s)


def test_a_weight_swap_under_kept_requests_leaves_no_stale_block_cached():
    """Issue 28 "keep": after `reset_prefix_cache(stale_held=True)` no block a live
    request holds is a hit, and the blocks it fills later (old and new weights' KV
    mixed) are never committed; once it ends, requests cache again."""
    s = make_scheduler(block_size=B, num_kv_blocks=40, budget=64)
    p = prompt(2 * B + 1, 9)
    s.add_request(make_req("kept", p, max_tokens=8))
    fr = FakeRunner(s, check_invariants=True)
    fr.step()  # the prefill: two full blocks committed
    kv = s.kv_cache_manager
    assert kv.get_computed_blocks(make_req("probe", p))[1] == 2 * B
    assert s.reset_prefix_cache(stale_held=True) == 2
    assert kv.get_computed_blocks(make_req("probe", p))[1] == 0
    while s.has_unfinished_requests():  # fills a third block after the swap
        fr.step()
    full = p + fr.finished["kept"].output_token_ids
    assert kv.get_computed_blocks(make_req("probe", full))[1] == 0
    s.add_request(make_req("fresh", p, max_tokens=2))
    while s.has_unfinished_requests():
        fr.step()
    assert kv.get_computed_blocks(make_req("probe", p))[1] == 2 * B  # caching again
    assert_pool_clean(s)
