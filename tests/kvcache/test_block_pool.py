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


def test_cache_blocks_indexes_each_pair_and_skips_known_content():
    pool = BlockPool(4)
    pool.events = ([], [])
    a, b, c = pool.allocate(3)
    pool.cache_block(a, 10)
    pool.cache_blocks([a, b, c], [10, 10, 30])  # a: indexed already; b: a's content
    assert (pool.lookup(10), pool.lookup(30)) == (a, c)
    assert pool.block_hash[b] is None
    assert pool.events[0] == [10, 30]
    with pytest.raises(ValueError):
        pool.cache_blocks([a, b], [10])  # pairs, or nothing


def test_allocating_cached_blocks_evicts_them_in_queue_order():
    pool = BlockPool(4)
    pool.evicted, pool.events = [], ([], [])
    blocks = _cached_free_blocks(pool, [1, 2, 3])
    assert list(pool.free_queue) == [3, *reversed(blocks)]  # the unhashed block first
    taken = pool.allocate(3)
    assert taken == [3, blocks[2], blocks[1]]
    assert pool.evicted == [(blocks[2], 3), (blocks[1], 2)]
    assert pool.events[1] == [3, 2] and pool.num_evicted == 2
    assert pool.lookup(1) == blocks[0] and pool.lookup(2) is None
    assert all(pool.ref_cnt[b] == 1 for b in taken)


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


def _cached_free_blocks(pool: BlockPool, hashes: list[int]) -> list[int]:
    """Blocks holding `hashes`, computed and freed (tail first), as after a request ends."""
    block_ids = pool.allocate(len(hashes))
    for block_id, block_hash in zip(block_ids, hashes):
        pool.cache_block(block_id, block_hash)
    pool.free(reversed(block_ids))
    return block_ids


def test_pinned_blocks_are_never_evicted_nor_counted_free():
    pool = BlockPool(6)
    a, b = _cached_free_blocks(pool, [10, 11])
    assert pool.num_free_blocks == 6
    assert pool.pin([10, 11]) == 2
    assert pool.num_free_blocks == 4 and pool.num_pinned_blocks == 2
    assert a not in pool.free_queue and b not in pool.free_queue
    assert sorted(pool.allocate(4)) == [2, 3, 4, 5]  # everything else, never a or b
    with pytest.raises(RuntimeError, match="0 free"):
        pool.allocate(1)
    assert pool.lookup(10) == a and pool.lookup(11) == b and pool.num_evicted == 0


def test_pin_is_idempotent_and_unpin_returns_blocks_to_the_lru_queue():
    pool = BlockPool(6)
    a, b = _cached_free_blocks(pool, [10, 11])
    pool.pin([10, 11])
    assert pool.pin([10, 11]) == 2  # again: no second reference
    assert pool.ref_cnt[a] == pool.ref_cnt[b] == 1
    assert pool.unpin([10, 11]) == 2
    assert pool.num_free_blocks == 6 and pool.num_pinned_blocks == 0
    assert list(pool.free_queue)[-2:] == [b, a]  # cached, tail evicted first
    assert pool.lookup(10) == a  # still cached after the unpin
    assert pool.unpin([10, 11]) == 0


def test_pin_shares_blocks_with_running_requests():
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    pool.cache_block(a, 10)
    pool.pin([10])
    assert pool.ref_cnt[a] == 2 and pool.num_free_blocks == 3
    pool.free([a])  # the request ends: the pin keeps it
    assert pool.num_free_blocks == 3
    pool.unpin([10])
    assert pool.num_free_blocks == 4 and pool.ref_cnt[a] == 0


def test_pin_skips_uncached_hashes_and_is_bounded():
    pool = BlockPool(4, max_pinned_fraction=0.5)
    _cached_free_blocks(pool, [10, 11, 12])
    assert pool.pin([99]) == 0
    pool.pin([10, 11])
    with pytest.raises(ValueError, match="cannot pin 1 more blocks: 2 of at most 2 pinned"):
        pool.pin([12])
    assert pool.num_pinned_blocks == 2 and pool.num_free_blocks == 2  # nothing changed
    with pytest.raises(ValueError, match="max_pinned_fraction"):
        BlockPool(4, max_pinned_fraction=1.5)
