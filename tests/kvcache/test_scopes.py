"""Cache scopes (kvcache/hashing.py): a salt at the chain's root keeps two scopes' equal
prompts apart; the shared scope's warm-ups are hit from every scope, never written by one."""

from pdserve.kvcache.hashing import SHARED_SCOPE, hash_blocks, root_hash, salted_root
from pdserve.kvcache.manager import KVCacheManager
from pdserve.request import Request
from pdserve.sampling_params import SamplingParams

PROMPT = list(range(100, 117))  # 4 full blocks of 4 and one token


def run(kv: KVCacheManager, rid: str, salt: str, tokens: list[int] = PROMPT) -> int:
    """Admit, compute and free a request; the number of blocks it hit."""
    request = Request(rid, list(tokens), SamplingParams(), cache_salt=salt)
    hits = kv.find_cached_prefix(request)
    assert kv.allocate(request, request.num_tokens - len(hits) * kv.block_size, hits)
    request.num_computed_tokens = request.num_tokens
    kv.cache_computed_blocks(request)
    kv.free(request)
    return len(hits)


def test_the_default_scope_is_the_plain_root_and_salts_differ():
    root = root_hash("m")
    assert salted_root(root, "") == root
    assert len({salted_root(root, s) for s in ("a", "b", SHARED_SCOPE)} - {root}) == 3
    kv = KVCacheManager(num_blocks=32, block_size=4, model_id="m")
    assert kv.prompt_block_hashes(PROMPT) == hash_blocks(PROMPT, 4, root)
    assert kv.prompt_block_hashes(PROMPT, "a") == hash_blocks(PROMPT, 4, salted_root(root, "a"))


def test_a_scope_never_hits_another_scopes_blocks():
    kv = KVCacheManager(num_blocks=32, block_size=4, model_id="m")
    assert run(kv, "a1", "tenant-a") == 0
    assert run(kv, "b1", "tenant-b") == 0  # the oracle: B learns nothing of A's prompt
    assert run(kv, "d1", "") == 0
    assert run(kv, "a2", "tenant-a") == 4  # A still hits its own
    assert run(kv, "b2", "tenant-b") == 4


def test_shared_warmups_are_hit_from_every_scope_and_never_written_by_one():
    kv = KVCacheManager(num_blocks=32, block_size=4, model_id="m")
    system = PROMPT[:8]  # two blocks the operator shares
    assert run(kv, "w", SHARED_SCOPE, system + [0]) == 0
    kv.pool.pin(kv.prompt_block_hashes(system, SHARED_SCOPE))
    assert run(kv, "a1", "tenant-a") == 2  # the shared prefix, then its own blocks computed
    assert run(kv, "a2", "tenant-a") == 4  # shared 2, then A's own blocks 2 and 3
    assert run(kv, "b1", "tenant-b") == 2  # never A's blocks 2 and 3
    shared = set(kv.prompt_block_hashes(PROMPT, SHARED_SCOPE))
    assert shared & set(kv.pool.cached_blocks) == set(kv.prompt_block_hashes(system, SHARED_SCOPE))


def test_room_counts_the_shared_pins_a_salted_prompt_takes():
    kv = KVCacheManager(num_blocks=8, block_size=4, model_id="m", max_pinned_fraction=0.5)
    run(kv, "w", SHARED_SCOPE, PROMPT[:8] + [0])
    kv.pool.pin(kv.prompt_block_hashes(PROMPT[:8], SHARED_SCOPE))
    assert kv.room_tokens(PROMPT, "tenant-a") == 8 * 4  # 6 unpinned + its 2 shared
    assert kv.room_tokens(list(range(9)), "tenant-a") == 6 * 4
