"""Prefix hits from the tiers below L1: blocks evicted from a small worker pool walk down to
host DRAM / disk / Redis, come back for a repeated prefix, and give the same greedy output."""

from __future__ import annotations

import pytest

from pdserve.config import CacheConfig, EngineConfig
from pdserve.engine.engine import Engine
from pdserve.kvcache.hashing import hash_blocks
from pdserve.kvstore.config import KVStoreConfig
from pdserve.transfer import make_receiver
from pdserve.transfer.layout import KVLayout
from tests.engine.test_engine import GREEDY, prompts, run
from tests.kvstore.conftest import redis_server  # noqa: F401  (fixture)

NUM_BLOCKS, BLOCK_SIZE = 24, 4


def engine(model_dir, store: KVStoreConfig) -> Engine:
    cache = CacheConfig(block_size=BLOCK_SIZE, kv_cache_bytes=NUM_BLOCKS * BLOCK_SIZE * 512)
    return Engine(EngineConfig(model="tiny", cache=cache, kvstore=store), model_dir)


def shared_prefix_run(eng: Engine, prefix: list[int]) -> tuple[list[int], int]:
    """Run prefix+tail, flush L1 with other prompts, run it again: (output, cached tokens)."""
    first = run(eng, [prefix + [7, 7]])[0]
    run(eng, prompts(4, seed=9, lo=30, hi=40))  # evicts the prefix's blocks from L1
    eng.offload.store.flush(5)
    first_block = hash_blocks(prefix, BLOCK_SIZE, eng.kv.root_hash)[0]
    assert eng.kv.pool.lookup(first_block) is None  # really gone from L1
    request = eng.add_request("again", prefix + [7, 7], GREEDY)
    out = []
    while eng.has_unfinished_requests():
        out += [t for o in eng.step() for t in o.new_token_ids]
    assert out == first
    return out, request.num_cached_tokens


@pytest.fixture
def prefix():
    return prompts(1, seed=3, lo=40, hi=41)[0]


def test_host_tier_serves_an_evicted_prefix(tiny_model_dir, tmp_path, prefix):
    eng = engine(tiny_model_dir, KVStoreConfig(host_bytes=1 << 20, host_root=str(tmp_path)))
    _, cached = shared_prefix_run(eng, prefix)
    assert cached == 40  # all 10 full blocks of the 42-token prompt (1 token left to compute)
    assert eng.offload.num_blocks_saved > 0 and eng.offload.num_tokens_loaded >= 40
    assert eng.kv.num_free_blocks == NUM_BLOCKS


def test_disk_tier_alone(tiny_model_dir, tmp_path, prefix):
    store = KVStoreConfig(disk_dir=str(tmp_path / "kv"), disk_bytes=1 << 20)
    _, cached = shared_prefix_run(engine(tiny_model_dir, store), prefix)
    assert cached == 40


def test_redis_tier_and_redis_dying(tiny_model_dir, prefix, redis_server):  # noqa: F811
    # A loaded machine can take longer than the default 0.25 s on the first connection, and a
    # timeout there marks the tier down (as in tests/cluster/test_redis_local.py).
    store = KVStoreConfig(redis_url=redis_server.url, redis_timeout_s=5.0)
    eng = engine(tiny_model_dir, store)
    _, cached = shared_prefix_run(eng, prefix)
    assert cached == 40
    redis_server.stop()  # every later lookup misses; requests still complete
    out = run(eng, prompts(3, seed=11, lo=30, hi=40))
    assert all(len(o) == GREEDY.max_tokens for o in out)


def test_without_tiers_the_prefix_is_recomputed(tiny_model_dir, prefix):
    eng = engine(tiny_model_dir, KVStoreConfig())
    assert eng.offload is None
    run(eng, [prefix + [7, 7]])
    run(eng, prompts(4, seed=9, lo=30, hi=40))
    request = eng.add_request("again", prefix + [7, 7], GREEDY)
    while eng.has_unfinished_requests():
        eng.step()
    assert request.num_cached_tokens == 0


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_8bit_blocks_and_scales_round_trip_through_a_tier(tiny_model_dir, tmp_path, prefix, kv):
    """FP8 (int8) blocks (values and their per-token scales) leave L1 and come back intact:
    the repeated request's output equals the first one's, computed from the same 8-bit KV."""
    cache = CacheConfig(
        block_size=BLOCK_SIZE,
        kv_cache_bytes=NUM_BLOCKS * BLOCK_SIZE * 512 // 4,
        kv_cache_dtype=kv,
    )
    store = KVStoreConfig(disk_dir=str(tmp_path / "kv"), disk_bytes=1 << 20)
    eng = Engine(EngineConfig(model="tiny", cache=cache, kvstore=store), tiny_model_dir)
    assert eng.runner.kv_cache.dtype.itemsize == 1
    _, cached = shared_prefix_run(eng, prefix)
    assert cached == 40


def test_a_reservation_saves_the_blocks_it_evicts_before_any_write(tiny_model_dir, tmp_path):
    """A decode worker's reservation can take cached blocks; what they held must reach the
    tiers before the reply goes out, since the prefill may write into them right after."""
    cache = CacheConfig(block_size=BLOCK_SIZE, kv_cache_bytes=NUM_BLOCKS * BLOCK_SIZE * 512)
    store = KVStoreConfig(host_bytes=1 << 20, host_root=str(tmp_path))
    eng = Engine(EngineConfig(model="tiny", cache=cache, kvstore=store), tiny_model_dir, "decode")
    layout = KVLayout.from_tensor(eng.runner.kv_cache)
    rx = make_receiver("tcp", eng.runner.kv_cache, layout, b"secret")
    eng.switch_role(eng.decode_role(rx))
    run(eng, prompts(2, seed=5, lo=40, hi=41))  # fills L1 with cached-but-free blocks
    cached = list(eng.kv.pool.cached_blocks)
    assert cached
    saved_before = eng.offload.num_blocks_saved
    assert eng.reserve("r", prompts(1, seed=6, lo=80, hi=81)[0], GREEDY) is not None
    assert eng.offload.num_blocks_saved > saved_before  # saved at once, not at the next step
    assert eng.offload.store.flush(5)
    gone = [h for h in cached if eng.kv.pool.lookup(h) is None]
    assert gone and all(eng.offload.store.contains(h) for h in gone)
    rx.close()


def test_cache_stats_count_a_hit_from_the_host_tier(tiny_model_dir, tmp_path, prefix):
    eng = engine(tiny_model_dir, KVStoreConfig(host_bytes=1 << 20, host_root=str(tmp_path)))
    run(eng, [prefix + [7, 7]])
    run(eng, prompts(4, seed=9, lo=30, hi=40))  # evicts the prefix's blocks from L1
    eng.offload.store.flush(5)
    before = eng.cache_stats()
    run(eng, [prefix + [7, 7]])
    after = eng.cache_stats()

    def delta(tier: str, key: str) -> int:
        return after["tiers"][tier][key] - before["tiers"][tier][key]

    block_bytes = eng.offload.block_bytes
    assert (delta("L1", "lookups"), delta("L1", "hits")) == (10, 0)  # loaded blocks are L2's
    assert delta("L2", "hits") == 10 and delta("L2", "lookups") >= 10
    assert delta("L1", "bytes_written") == 10 * block_bytes
    assert delta("L2", "bytes_read") >= 10 * block_bytes
    assert before["tiers"]["L1"]["bytes_read"] > 0 and before["tiers"]["L2"]["bytes_written"] > 0
    assert after["cached_prompt_tokens"] - before["cached_prompt_tokens"] == 40
    assert after["computed_prompt_tokens"] - before["computed_prompt_tokens"] == 2
