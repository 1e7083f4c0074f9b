from pdserve.kvcache.manager import KVCacheManager
from pdserve.request import Request
from pdserve.sampling_params import SamplingParams


def req(rid: str, n: int, start: int = 0) -> Request:
    return Request(rid, list(range(start, start + n)), SamplingParams())


def test_allocate_exact_block_ids_and_free():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = req("a", 10)
    assert kv.allocate(r, 10)
    assert r.block_ids == [0, 1, 2]
    r.num_computed_tokens = 10
    assert kv.allocate(r, 1)  # token 11 still fits in block 2
    assert r.block_ids == [0, 1, 2]
    r.num_computed_tokens = 12
    assert kv.allocate(r, 1)
    assert r.block_ids == [0, 1, 2, 3]
    kv.free(r)
    assert kv.num_free_blocks == 8 and r.block_ids == []


def test_allocate_fails_without_side_effects():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    r = req("a", 9)
    assert not kv.allocate(r, 9)
    assert r.block_ids == [] and kv.num_free_blocks == 2


def test_prefix_hit_reuses_blocks_and_leaves_one_token():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", 8)
    kv.allocate(a, 8)
    a.num_computed_tokens = 8
    kv.cache_computed_blocks(a)
    kv.free(a)  # blocks 0, 1 stay cached in the free queue

    b = req("b", 8)  # same 8 tokens: only block 0 may hit, the last token is computed
    hits = kv.find_cached_prefix(b)
    assert hits == [0]
    assert kv.allocate(b, 4, hits)
    assert b.block_ids == [0, 2]  # block 1 is still cached: an unhashed block goes first
    assert b.num_computed_tokens == 4 and b.num_cached_tokens == 4

    c = req("c", 12)  # first 8 tokens equal: both cached blocks hit, one shared with b
    assert kv.find_cached_prefix(c) == [0, 1]
    assert kv.allocate(c, 4, [0, 1])
    assert kv.pool.ref_cnt[0] == 2 and c.block_ids == [0, 1, 3]
    kv.free(b)
    kv.free(c)
    assert kv.num_free_blocks == 8


def test_prefix_hit_counts_free_hit_blocks_against_capacity():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = req("a", 8)
    kv.allocate(a, 8)
    a.num_computed_tokens = 8
    kv.cache_computed_blocks(a)
    kv.free(a)
    b = req("b", 9)
    hits = kv.find_cached_prefix(b)
    assert len(hits) == 2
    assert not kv.allocate(b, 1, hits)  # 2 hit blocks + 1 new > 2 blocks
    assert kv.num_free_blocks == 2


def test_different_prefix_misses():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = req("a", 8)
    kv.allocate(a, 8)
    a.num_computed_tokens = 8
    kv.cache_computed_blocks(a)
    assert kv.find_cached_prefix(req("b", 9, start=1)) == []
    assert KVCacheManager(4, 4, enable_prefix_caching=False).find_cached_prefix(a) == []
