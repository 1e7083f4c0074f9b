"""Cumulative prefix-cache counts per tier, as the worker reports them in Stats.

    L1  the worker's pool: lookups = prompt blocks that could hit, hits = found there;
        bytes_written = blocks loaded up from below, bytes_read = blocks copied down
    L2 host, L3 disk, L4 redis: lookups = blocks asked of the tier (what the tiers above
        missed), hits, bytes read from / written to it (entries as stored)

Every count only grows while the worker lives, so the router can export them as counters.
"""

from __future__ import annotations

from typing import Any

from pdserve.engine.kv_offload import KVOffload
from pdserve.kvcache.manager import KVCacheManager

TIER_LEVELS = {"host": "L2", "disk": "L3", "redis": "L4"}


def cache_stats(kv: KVCacheManager, offload: KVOffload | None) -> dict[str, Any]:
    c = kv.counters
    l1 = {
        "lookups": c.l1_lookup_blocks,
        "hits": c.l1_hit_blocks,
        "bytes_read": 0,
        "bytes_written": 0,
    }
    tiers: dict[str, dict[str, int]] = {"L1": l1}
    moved: dict[str, int] = {}
    if offload is not None:
        l1["bytes_read"] = offload.num_blocks_saved * offload.block_bytes
        l1["bytes_written"] = offload.num_tokens_loaded // kv.block_size * offload.block_bytes
        store = offload.store.stats()
        for i, t in enumerate(store["tiers"]):
            hits = int(t.get("hits", 0)) + (store["pending_hits"] if i == 0 else 0)
            tiers[_level(t["name"])] = {
                "lookups": hits + int(t.get("misses", 0)),
                "hits": hits,
                "bytes_read": int(t.get("bytes_read", 0)),
                "bytes_written": int(t.get("bytes_written", 0)),
            }
        for path, num_bytes in store["moved_bytes"].items():
            src, dst = path.split("->")
            moved[f"{_level(src)}->{_level(dst)}"] = num_bytes
    return {
        "tiers": tiers,
        "moved_bytes": moved,
        "cached_prompt_tokens": c.cached_prompt_tokens,
        "computed_prompt_tokens": c.computed_prompt_tokens,
        "num_pinned_blocks": kv.pool.num_pinned_blocks,
    }


def _level(name: str) -> str:
    return TIER_LEVELS.get(name, name)
