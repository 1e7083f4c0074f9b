import pytest

from pdserve.kvcache.block_pool import BlockPool


def test_allocate_takes_from_front_and_free_returns_in_order():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.num_free_blocks == 2
    pool.free([1, 0])
    # Unhashed blocks go to the front: handed out again first.
    assert list(pool.free_queue) == [0, 1, 2, 3]


def test_hashed_free_block_stays_findable_until_reallocated():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache_block(a, 111)
    pool.free([b, a])
    assert pool.lookup(111) == a
    assert list(pool.free_queue) == [b, 2, a]  # cached block evicted last
    pool.allocate(2)
    assert pool.lookup(111) == a
    pool.allocate(1)  # now `a` is handed out: its hash is gone
    assert pool.lookup(111) is None
    assert pool.num_evicted == 1


def test_touch_revives_free_cached_block_and_refcounts():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache_block(a, 7)
    pool.touch([a])
    assert pool.ref_cnt[a] == 2
    pool.free([a])
    pool.free([a])
    assert pool.num_free_blocks == 2
    pool.touch([a])
    assert pool.num_free_blocks == 1 and pool.ref_cnt[a] == 1


def test_duplicate_content_keeps_first_block():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, 5)
    pool.cache_block(b, 5)
    assert pool.lookup(5) == a and pool.block_hash[b] is None


def test_errors():
    pool = BlockPool(1)
    with pytest.raises(RuntimeError, match="cannot allocate"):
        pool.allocate(2)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([0])
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_caching_disabled_never_indexes():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.allocate(1)
    pool.cache_block(a, 9)
    assert pool.lookup(9) is None
