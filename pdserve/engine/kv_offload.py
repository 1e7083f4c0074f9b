"""The worker pool (L1) joined to the tiers below it: host DRAM, disk, Redis (docs/tiers.md).

- Down: a cached block about to be reused for other tokens is copied out (all layers) and
  put into the store before the step that overwrites it; the store writes it on down its
  tiers as they fill.
- Up: when a request arrives, a background thread looks up the block hashes past its L1
  prefix in the store. The request waits (not holding blocks) until the lookup is done; the
  blocks found are copied into free L1 blocks and indexed as cached, so the scheduler's
  ordinary prefix match takes them and those tokens are not recomputed.

A tier that is down, full, corrupt or foreign is just a miss (kvstore guarantees it).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pdserve.kvcache.manager import KVCacheManager
from pdserve.kvstore.tiered import TieredStore
from pdserve.request import Request

log = logging.getLogger(__name__)


class KVOffload:
    def __init__(self, store: TieredStore, kv: KVCacheManager, kv_cache: torch.Tensor) -> None:
        self.store, self.kv, self.kv_cache = store, kv, kv_cache
        kv.pool.evicted = []
        self.block_shape = (kv_cache.shape[0], *kv_cache.shape[2:])
        self.block_bytes = kv_cache[:, 0].numel() * kv_cache.element_size()  # all layers
        self.lookups = ThreadPoolExecutor(1, thread_name_prefix="kv-offload")
        self.num_tokens_loaded = 0
        self.num_blocks_saved = 0

    def save_evicted(self) -> None:
        """Copy out every cached block the last schedule() handed out for reuse."""
        evicted, self.kv.pool.evicted = self.kv.pool.evicted, []
        for block_id, block_hash in evicted:
            block = self.kv_cache[:, block_id].contiguous()
            self.store.put(block_hash, block.view(torch.uint8).view(-1).numpy())
            self.num_blocks_saved += 1

    def lookup(self, request: Request) -> Future:
        """Start fetching the request's blocks that follow its L1 prefix."""
        self.kv.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.kv.block_size  # one token is computed
        hashes = request.block_hashes[:max_blocks]
        first = len(self.kv.cached_prefix(hashes))
        return self.lookups.submit(self._fetch, hashes, first)

    def _fetch(self, hashes: list[int], first: int) -> tuple[int, list[bytes]]:
        return first, self.store.get_prefix(hashes[first:]) if first < len(hashes) else []

    def install(self, request: Request, found: tuple[int, list[bytes]]) -> None:
        """Put fetched blocks into free L1 blocks, indexed by hash, unreferenced: the
        scheduler's prefix match takes them like any cached block."""
        first, payloads = found
        if not payloads or self.kv.num_free_blocks < len(payloads):
            return
        hashes = request.block_hashes[first : first + len(payloads)]
        if any(self.kv.pool.lookup(h) is not None for h in hashes):
            return  # computed meanwhile by another request: L1 already has it
        block_ids = self.kv.pool.allocate(len(payloads))
        self.save_evicted()  # what these blocks held goes down before it is overwritten
        for block_id, block_hash, payload in zip(block_ids, hashes, payloads):
            data = torch.frombuffer(bytearray(payload), dtype=self.kv_cache.dtype)
            self.kv_cache[:, block_id] = data.view(self.block_shape).to(self.kv_cache.device)
            self.kv.pool.cache_block(block_id, block_hash)
        self.kv.pool.free(reversed(block_ids))
        request.num_loaded_blocks = len(payloads)
        self.num_tokens_loaded += len(payloads) * self.kv.block_size

    def close(self) -> None:
        self.lookups.shutdown(wait=True, cancel_futures=True)
        self.store.close()
