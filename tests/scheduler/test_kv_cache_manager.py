"""KVCacheManager unit tests: null block, can_allocate/allocate pairing, ref
counts, hash chaining, usage."""

import pytest

from jaxserve.scheduler.kv_cache_manager import KVCacheManager, hash_block

from ._util import make_req


def test_allocate_free_and_null_block():
    kv = KVCacheManager(6, 4, enable_prefix_caching=False)  # 5 usable
    r = make_req("r", 9)
    assert kv.num_blocks == 5 and kv.num_free_blocks == 5 and kv.usage == 0.0
    assert kv.can_allocate(r, 9)
    fresh = kv.allocate(r, 9)
    assert len(fresh) == 3 and 0 not in fresh  # ceil(9 / 4)
    assert kv.get_block_ids("r") == tuple(fresh) and kv.usage == pytest.approx(3 / 5)
    r.num_computed_tokens = 9
    assert kv.try_allocate(r, 3)  # positions 9..11 fit the third block: no new block
    assert kv.num_free_blocks == 2
    assert not kv.can_allocate(r, 12)  # would need 3 more
    with pytest.raises(RuntimeError, match="without room"):
        kv.allocate(r, 12)
    assert kv.num_free_blocks == 2 and len(kv.get_block_ids("r")) == 3  # nothing changed
    assert not kv.try_allocate(r, 12)
    assert kv.free("r") == 3 and kv.num_free_blocks == 5
    kv.check_invariants([])


def test_hash_chain_depends_on_the_whole_prefix():
    a = hash_block(None, [1, 2, 3, 4])
    b = hash_block(None, [9, 2, 3, 4])
    assert a != b and len(a) == 16
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(b, [5, 6, 7, 8])
    assert hash_block(a, [5, 6, 7, 8]) == hash_block(a, [5, 6, 7, 8])


def test_hits_take_references_and_evictable_hits_cost_free_blocks():
    kv = KVCacheManager(8, 4)  # 7 usable
    p = list(range(10, 22))  # 12 tokens = 3 full blocks
    a = make_req("a", p)
    kv.allocate(a, 12)
    a.num_computed_tokens = 12
    kv.commit(a)
    assert kv.num_cached_blocks == 3
    b = make_req("b", p)
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and hits == list(kv.get_block_ids("a")[:2])  # last token always computed
    kv.allocate(b, 4, hits)
    assert [kv.ref_count(x) for x in hits] == [2, 2]
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 7 and kv.num_cached_blocks == 3
    # Now the hit blocks are free (evictable): taking them consumes free blocks.
    c = make_req("c", p)
    hits, n = kv.get_computed_blocks(c)
    assert n == 8
    kv.allocate(c, 4, hits)
    assert kv.num_free_blocks == 7 - 3
    kv.check_invariants(["c"])
