"""Reference-counted KV blocks with an LRU free queue and a hash index for prefix reuse.

A block is in exactly one of two states:
  - in use: ref_cnt > 0, owned by one or more requests (shared prefixes);
  - free:   ref_cnt == 0, in `free_queue` in eviction order (front = evicted first). A free
            block that still has a hash stays findable until it is handed out again, so a
            later request with the same prefix can take it back without recomputation.

Pinning (cache warm-up) holds one extra reference on a cached block, so a pinned block is
"in use" by the pool itself: never in the free queue, never evicted nor handed out, and
`num_free_blocks` stays `len(free_queue)` with no special case.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable


class BlockPool:
    def __init__(
        self, num_blocks: int, enable_caching: bool = True, max_pinned_fraction: float = 0.5
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if not 0 <= max_pinned_fraction <= 1:
            raise ValueError(f"max_pinned_fraction must be in [0, 1], got {max_pinned_fraction}")
        self.max_pinned_blocks = int(num_blocks * max_pinned_fraction)
        # Hashes of pinned blocks. A set, not counts: pinning is declarative operator state
        # ("keep these prompts warm"), so a replayed or repeated warm-up never stacks pins that
        # one unpin could not release. The price: unpinning a prompt also unpins the blocks
        # it shares with another pinned prompt (warm that one again).
        self.pinned: set[int] = set()
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[int, int] = {}  # block hash -> block id
        self.num_evicted = 0
        # (block id, hash) of cached blocks handed out again, when a lower tier wants them
        # (drained before the step that overwrites them); None: not recorded.
        self.evicted: list[tuple[int, int]] | None = None
        # Hashes indexed / dropped since last drained, for KV-aware routing; None: off.
        self.events: tuple[list[int], list[int]] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks from the front of the free queue, evicting their hashes."""
        if num_blocks > len(self.free_queue):
            raise RuntimeError(f"cannot allocate {num_blocks} blocks, {self.num_free_blocks} free")
        # A long prompt takes thousands of blocks: list-wide passes, no call per block.
        free_queue, block_hash, ref_cnt = self.free_queue, self.block_hash, self.ref_cnt
        block_ids = list(itertools.islice(free_queue, num_blocks))
        for block_id in block_ids:
            del free_queue[block_id]
            ref_cnt[block_id] = 1
        evicted = [(b, block_hash[b]) for b in block_ids if block_hash[b] is not None]
        if evicted:
            self._evict(evicted)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks found by hash (a prefix hit)."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self.free_queue[block_id]
            self.ref_cnt[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block. Callers pass a request's blocks tail first, so
        the tail of a prefix is evicted before its head (heads are shared more often)."""
        ref_cnt, block_hash, free_queue = self.ref_cnt, self.block_hash, self.free_queue
        for block_id in block_ids:
            count = ref_cnt[block_id]
            if count <= 0:
                raise RuntimeError(f"double free of block {block_id}")
            ref_cnt[block_id] = count - 1
            if count == 1:
                free_queue[block_id] = None
                if block_hash[block_id] is None:
                    # Nothing to reuse: hand it out before blocks that hold a cached prefix.
                    free_queue.move_to_end(block_id, last=False)

    def cache_block(self, block_id: int, block_hash: int) -> None:
        """Make a full, computed block findable by its hash. If another block already holds
        the same content, keep that one: this copy stays private and is freed plainly."""
        self.cache_blocks((block_id,), (block_hash,))

    def cache_blocks(self, block_ids: Iterable[int], block_hashes: Iterable[int]) -> None:
        """`cache_block` for each pair, in one call (a landed prompt indexes thousands)."""
        if not self.enable_caching:
            return
        cached_blocks, hash_of = self.cached_blocks, self.block_hash
        for block_id, block_hash in zip(block_ids, block_hashes, strict=True):
            # Skip a block indexed already, or content another block holds already.
            if hash_of[block_id] is not None or block_hash in cached_blocks:
                continue
            hash_of[block_id] = block_hash
            cached_blocks[block_hash] = block_id
            if self.events is not None:
                self.events[0].append(block_hash)

    def pin(self, block_hashes: Iterable[int]) -> int:
        """Keep the cached blocks of these hashes resident until unpinned; returns how many
        of the given hashes are pinned now. Hashes not in the cache are skipped (nothing to
        keep). Idempotent. All or nothing: ValueError if the pinned share would pass its bound."""
        block_hashes = list(block_hashes)
        new = {h for h in block_hashes if h in self.cached_blocks and h not in self.pinned}
        self.check_pin_room(new)
        self.touch(self.cached_blocks[h] for h in new)
        self.pinned |= new
        return sum(1 for h in block_hashes if h in self.pinned)

    def check_pin_room(self, block_hashes: Iterable[int]) -> None:
        """ValueError naming the numbers if pinning these blocks (cached now or once computed)
        would pass the bound on the pinned share."""
        num_new = len({h for h in block_hashes if h not in self.pinned})
        if len(self.pinned) + num_new > self.max_pinned_blocks:
            raise ValueError(
                f"cannot pin {num_new} more blocks: {len(self.pinned)} of at most "
                f"{self.max_pinned_blocks} pinned (max_pinned_fraction of {self.num_blocks} blocks)"
            )

    def unpin(self, block_hashes: Iterable[int]) -> int:
        """Release pinned blocks to the LRU free queue (or to the requests still using them);
        returns how many were pinned. Unknown or unpinned hashes are ignored."""
        gone = [h for h in dict.fromkeys(block_hashes) if h in self.pinned]
        self.pinned.difference_update(gone)
        self.free(self.cached_blocks[h] for h in reversed(gone))
        return len(gone)

    @property
    def num_pinned_blocks(self) -> int:
        return len(self.pinned)

    def drain_events(self) -> tuple[list[int], list[int]]:
        """(stored, removed) hashes since the last call; starts recording on first use."""
        events, self.events = self.events, ([], [])
        return events or ([], [])

    def lookup(self, block_hash: int) -> int | None:
        return self.cached_blocks.get(block_hash)

    def _evict(self, evicted: list[tuple[int, int]]) -> None:
        """Drop these (block id, hash) pairs from the index: the blocks are handed out again."""
        for block_id, block_hash in evicted:
            del self.cached_blocks[block_hash]
            self.block_hash[block_id] = None
        self.num_evicted += len(evicted)
        if self.evicted is not None:
            self.evicted.extend(evicted)
        if self.events is not None:
            self.events[1].extend(h for _, h in evicted)
