"""Per-request KV block accounting on top of the block pool. Integers only: no torch."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.kvcache.block_pool import BlockPool
from pdserve.kvcache.hashing import SHARED_SCOPE, hash_block, hash_blocks, root_hash, salted_root
from pdserve.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class CacheCounters:
    """Cumulative prefix-cache counts since start, taken once per admission (a preempted
    request is counted again when readmitted: its tokens really are looked up again).

    L1 lookups are a prompt's full blocks that could be hit (all but the last token);
    L1 hits the ones the pool already held, not counting blocks a lower tier loaded into
    it for this request (those are that tier's hits)."""

    l1_lookup_blocks: int = 0
    l1_hit_blocks: int = 0
    cached_prompt_tokens: int = 0  # served from the cache, any tier
    computed_prompt_tokens: int = 0


class KVCacheManager:
    """Gives requests blocks, finds prefix hits and returns blocks when requests end.

    Invariant: a request's `block_ids` cover exactly its tokens with KV (computed or being
    computed this step); `block_hashes` cover at least its full blocks with KV, and
    `update_block_hashes` extends them to every full block of its tokens before they are read.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        model_id: str = "",
        enable_prefix_caching: bool = True,
        max_pinned_fraction: float = 0.5,
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching, max_pinned_fraction)
        self.counters = CacheCounters()
        self.enable_prefix_caching = enable_prefix_caching
        self.root_hash = root_hash(model_id)
        self.shared_root = salted_root(self.root_hash, SHARED_SCOPE)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def update_block_hashes(self, request: Request) -> None:
        """Extend the request's hashes to every full block of its current tokens."""
        num_full = request.num_tokens // self.block_size
        have = len(request.block_hashes)
        if num_full > have:
            parent = request.block_hashes[-1] if have else self.root_of(request.cache_salt)
            tokens = request.token_slice(have * self.block_size, num_full * self.block_size)
            if num_full == have + 1:  # a decode's new block: hash_blocks' set-up costs more
                request.block_hashes.append(hash_block(parent, tokens))
            else:
                request.block_hashes += hash_blocks(tokens, self.block_size, parent)

    def root_of(self, cache_salt: str) -> int:
        """The root of a cache scope's chain (kvcache/hashing.py): "" is the default scope."""
        return salted_root(self.root_hash, cache_salt)

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids of the longest cached prefix of a request that holds no blocks yet.

        At least one token is always left to compute: the last one's logits give the next
        token, and a hit on the whole prompt would leave nothing to run.

        The prefix is looked up in the request's own scope and in the shared warm-ups': a
        shared hit of k blocks is followed by the request's own blocks from block k on (its
        scope's chain covers every block, so a later block's hash still pins its prefix).
        The request's own new blocks are hashed in its scope only: a request never writes
        into the shared scope.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return []  # prompt logprobs need every position's logits: all of it is computed
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes[:max_blocks]
        hits = self.cached_prefix(hashes)
        if request.cache_salt != SHARED_SCOPE and len(hits) < max_blocks:
            shared = self._shared_prefix(request, max_blocks)
            if len(shared) > len(hits):
                hits = shared + self.cached_prefix(hashes[len(shared) :])
        return hits

    def _shared_prefix(self, request: Request, max_blocks: int) -> list[int]:
        """Block ids of the longest prefix of the request warmed in the shared scope; one
        hash per block it hits plus one (most requests: one hash, a miss)."""
        hits, parent, size = [], self.shared_root, self.block_size
        for index in range(max_blocks):
            parent = hash_block(parent, request.token_slice(index * size, (index + 1) * size))
            block_id = self.pool.lookup(parent)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def cached_prefix(self, block_hashes: list[int]) -> list[int]:
        """Block ids of the longest prefix of `block_hashes` the pool holds now."""
        hits = []
        for block_hash in block_hashes:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def prompt_block_hashes(self, token_ids: list[int], cache_salt: str = "") -> list[int]:
        """Hashes of every full block of `token_ids` in a cache scope (what warm-up pins and
        unpin release)."""
        return hash_blocks(token_ids, self.block_size, self.root_of(cache_salt))

    def room_tokens(self, token_ids: list[int], cache_salt: str = "") -> int:
        """Tokens one request starting with `token_ids` can ever hold: every block but the
        pinned ones (held for good, unlike a running request's), plus the pinned blocks of
        its own prefix, which it shares (in its scope or the shared warm-ups')."""
        pinned = self.pool.pinned
        shared = 0
        for salt in {cache_salt, SHARED_SCOPE} if pinned else ():
            hashes = self.prompt_block_hashes(token_ids, salt)
            shared = max(shared, sum(h in pinned for h in hashes))
        return (self.num_blocks - len(pinned) + shared) * self.block_size

    def num_cached_tokens(self, block_hashes: list[int]) -> int:
        """Tokens of the longest prefix of these blocks the pool holds now."""
        return len(self.cached_prefix(block_hashes)) * self.block_size

    def record_admission(self, request: Request, num_hit_blocks: int) -> None:
        c = self.counters
        num_hit_tokens = num_hit_blocks * self.block_size
        if self.enable_prefix_caching:
            c.l1_lookup_blocks += (request.num_tokens - 1) // self.block_size
            c.l1_hit_blocks += num_hit_blocks - min(request.num_loaded_blocks, num_hit_blocks)
        request.num_loaded_blocks = 0
        c.cached_prompt_tokens += num_hit_tokens
        c.computed_prompt_tokens += request.num_tokens - num_hit_tokens

    def num_blocks_needed(self, request: Request, num_new_tokens: int, num_hit_blocks: int) -> int:
        num_tokens = request.num_kv_tokens + num_hit_blocks * self.block_size + num_new_tokens
        return max(0, cdiv(num_tokens, self.block_size) - len(request.block_ids) - num_hit_blocks)

    def allocate(
        self, request: Request, num_new_tokens: int, hit_block_ids: list[int] | None = None
    ) -> bool:
        """Reserve blocks for `num_new_tokens` more tokens (after taking `hit_block_ids`, a
        cached prefix found for a request with no blocks). False, changing nothing, if the
        free blocks do not suffice; hit blocks that are themselves free count as taken."""
        if not hit_block_ids:
            num_tokens = request.num_computed_tokens - request.num_dropped_tokens + num_new_tokens
            if num_tokens <= len(request.block_ids) * self.block_size:
                return True  # its blocks have room (most decode steps)
            hit_block_ids = []
        need = self.num_blocks_needed(request, num_new_tokens, len(hit_block_ids))
        num_hits_free = sum(1 for b in hit_block_ids if self.pool.ref_cnt[b] == 0)
        if need + num_hits_free > self.pool.num_free_blocks:
            return False
        if hit_block_ids:
            self.pool.touch(hit_block_ids)
            request.block_ids += hit_block_ids
            num_hit_tokens = len(hit_block_ids) * self.block_size
            request.num_computed_tokens += num_hit_tokens
            request.num_cached_tokens = num_hit_tokens
        request.block_ids += self.pool.allocate(need)
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Index the request's full blocks whose KV is now computed."""
        if not self.enable_prefix_caching or request.num_dropped_tokens:
            return  # after a drop, block i no longer holds the tokens of hash i
        num_full_computed = request.num_computed_tokens // self.block_size
        # Blocks are indexed in prefix order, so everything before the last block that holds
        # a hash was indexed by an earlier call: start after it (a decode step's call is O(1),
        # not O(context)). Blocks whose content another block holds stay unhashed; they are
        # re-offered, a no-op.
        block_hash, block_ids = self.pool.block_hash, request.block_ids
        start = num_full_computed
        while start > 0 and block_hash[block_ids[start - 1]] is None:
            start -= 1
        if start == num_full_computed:
            return  # nothing new (most decode steps): its hashes are extended when read
        self.update_block_hashes(request)
        end = num_full_computed
        self.pool.cache_blocks(block_ids[start:end], request.block_hashes[start:end])

    def free(self, request: Request) -> None:
        self.pool.free(reversed(request.block_ids))
        request.block_ids = []
