"""Cache warm-up on a worker (docs/ARCHITECTURE.md, "KV cache layout"): a warm-up is an
ordinary request (`WARMUP_PARAMS`) whose prompt blocks are pinned once it finishes; these
are its checks before it starts, its pinning after, and unpin. Pins are made and released in
the warm-up's cache scope (`cache_salt`, kvcache/hashing.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.kvcache.manager import KVCacheManager
from pdserve.request import Request

if TYPE_CHECKING:
    from pdserve.engine.roles.base import Role


def check_pin(
    kv: KVCacheManager, role: Role, prompt_token_ids: list[int], pin: bool, cache_salt: str
) -> None:
    """ValueError when this worker cannot take the warm-up: decode role, caching off,
    pinned share full."""
    if not role.takes_pins:
        raise ValueError(f"warm-up runs on prefill and collocated workers, not {role.name}")
    if not kv.enable_prefix_caching:
        raise ValueError("warm-up needs prefix caching, which is off on this worker")
    if pin:
        kv.pool.check_pin_room(kv.prompt_block_hashes(prompt_token_ids, cache_salt))


def finish_warmup(kv: KVCacheManager, request: Request) -> tuple[int, int, str | None]:
    """Pin a finished warm-up's blocks (when it asked to): (tokens pinned, prompt tokens the
    cache holds now, the error when pinning was refused)."""
    hashes = kv.prompt_block_hashes(request.prompt_token_ids, request.cache_salt)
    num_pinned, error = 0, None
    if request.pin:
        try:
            num_pinned = kv.pool.pin(hashes) * kv.block_size
        except ValueError as exc:  # pins made meanwhile filled the share
            error = str(exc)
    return num_pinned, kv.num_cached_tokens(hashes), error


def unpin(kv: KVCacheManager, prompt_token_ids: list[int], cache_salt: str) -> tuple[int, int]:
    """Release a prompt's pinned blocks to the LRU queue: (tokens unpinned, tokens still
    cached)."""
    hashes = kv.prompt_block_hashes(prompt_token_ids, cache_salt)
    num_unpinned = kv.pool.unpin(hashes)
    return num_unpinned * kv.block_size, kv.num_cached_tokens(hashes)
