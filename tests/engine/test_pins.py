"""Cache warm-up: a prompt prefilled and pinned ahead of traffic is hit by the first real
request, survives eviction pressure, and its blocks come back when unpinned."""

import pytest

from pdserve.config import CacheConfig, EngineConfig
from pdserve.engine.engine import Engine
from pdserve.request import WARMUP_PARAMS
from pdserve.transfer import make_receiver, make_sender
from pdserve.transfer.layout import KVLayout
from tests.engine.test_engine import GREEDY, make_engine, prompts, run

SECRET = b"k" * 32


def layout(engine: Engine) -> KVLayout:
    return KVLayout.from_tensor(engine.runner.kv_cache)


SYSTEM = prompts(1, seed=11, lo=30, hi=31)[0]  # 30 tokens: 7 full blocks of 4


def warm(engine: Engine, prompt: list[int], pin: bool = True, request_id: str = "w"):
    engine.add_request(request_id, prompt, WARMUP_PARAMS, pin=pin)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (result,) = outputs  # one token, the warm-up's own
    assert result.request_id == request_id and result.finished
    return result


def test_warmup_then_first_request_hits_and_output_is_unchanged(tiny_model_dir):
    cold = make_engine(tiny_model_dir)
    expected = run(cold, [SYSTEM + [5, 6]])[0]
    engine = make_engine(tiny_model_dir)
    result = warm(engine, SYSTEM)
    assert (result.num_cached_tokens, result.num_pinned_tokens, result.error) == (28, 28, None)
    request = engine.add_request("real", SYSTEM + [5, 6], GREEDY)
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    assert tokens == expected and request.num_cached_tokens == 28


def test_pinned_prompt_survives_eviction_and_unpin_restores_free_blocks(tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_blocks=24)
    warm(engine, SYSTEM)
    assert engine.kv.num_free_blocks == 24 - 7 and engine.kv.pool.num_pinned_blocks == 7
    run(engine, prompts(6, seed=2, lo=30, hi=40))  # would evict every unpinned block
    assert engine.kv.num_cached_tokens(engine.kv.prompt_block_hashes(SYSTEM)) == 28
    assert engine.kv.num_free_blocks == 24 - 7
    assert engine.unpin(SYSTEM) == (28, 28)  # unpinned, still cached until evicted
    assert engine.kv.num_free_blocks == 24 and engine.kv.pool.num_pinned_blocks == 0
    assert engine.unpin(SYSTEM)[0] == 0


def test_warmup_without_pin_only_caches(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    result = warm(engine, SYSTEM, pin=False)
    assert (result.num_cached_tokens, result.num_pinned_tokens) == (28, 0)
    assert engine.kv.num_free_blocks == 256


def test_pin_beyond_the_bound_is_refused_before_any_work(tiny_model_dir):
    cache = CacheConfig(block_size=4, kv_cache_bytes=24 * 4 * 512, max_pinned_fraction=0.25)
    engine = Engine(EngineConfig(model="tiny", cache=cache), tiny_model_dir)
    with pytest.raises(ValueError, match="cannot pin 7 more blocks: 0 of at most 6 pinned"):
        engine.add_request("w", SYSTEM, WARMUP_PARAMS, pin=True)
    assert not engine.has_unfinished_requests()
    assert warm(engine, SYSTEM[:24]).num_pinned_tokens == 24  # 6 blocks fit
    assert warm(engine, SYSTEM[:24], request_id="again").num_pinned_tokens == 24  # idempotent


def test_warmup_on_the_prefill_role_and_not_on_decode(tiny_model_dir):
    cache = CacheConfig(block_size=4, kv_cache_bytes=64 * 4 * 512)
    prefill = Engine(EngineConfig(model="tiny", cache=cache), tiny_model_dir, "prefill")
    decode = Engine(EngineConfig(model="tiny", cache=cache), tiny_model_dir, "decode")
    tx = make_sender("tcp", prefill.runner.kv_cache, prefill_layout := layout(prefill), SECRET)
    rx = make_receiver("tcp", decode.runner.kv_cache, prefill_layout, SECRET)
    try:
        prefill.switch_role(prefill.prefill_role(tx, "full"))
        decode.switch_role(decode.decode_role(rx))
        assert warm(prefill, SYSTEM).num_pinned_tokens == 28
        with pytest.raises(ValueError, match="not decode"):
            decode.add_request("w", SYSTEM, WARMUP_PARAMS, pin=True)
    finally:
        tx.close()
        rx.close()


def test_cache_counters_split_cached_and_computed_tokens(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    warm(engine, SYSTEM, pin=False)  # 30 computed, 7 lookups, 0 hits
    run(engine, [SYSTEM + [5, 6]])  # 32 tokens: 7 full blocks hit out of 7 lookups
    stats = engine.cache_stats()
    assert stats["tiers"] == {"L1": {"lookups": 14, "hits": 7, "bytes_read": 0, "bytes_written": 0}}
    assert (stats["cached_prompt_tokens"], stats["computed_prompt_tokens"]) == (28, 30 + 4)


def test_a_prompt_that_fits_the_context_but_not_the_unpinned_blocks_is_refused(tiny_model_dir):
    cache = CacheConfig(block_size=4, kv_cache_bytes=24 * 4 * 512, max_pinned_fraction=0.75)
    engine = Engine(EngineConfig(model="tiny", cache=cache), tiny_model_dir)
    assert engine.max_model_len == 96  # the whole cache: pins do not change it
    for i, pinned in enumerate(prompts(2, seed=5, lo=36, hi=37)):
        assert warm(engine, pinned, request_id=f"w{i}").num_pinned_tokens == 36
    assert engine.kv.pool.num_pinned_blocks == 18  # 6 blocks (24 tokens) left
    with pytest.raises(ValueError, match="prompt has 40 tokens; .* room for 23"):
        engine.add_request("long", prompts(1, seed=7, lo=40, hi=41)[0], GREEDY)
    assert not engine.has_unfinished_requests()  # nothing queued behind which others wait
    assert len(run(engine, [[5, 6, 7]])[0]) > 0  # a small request completes
    # A prompt on the pinned prefix shares those blocks: it fits in the pins plus the rest.
    engine.add_request("shared", pinned + [5] * 20, GREEDY)
    engine.abort_request("shared")
