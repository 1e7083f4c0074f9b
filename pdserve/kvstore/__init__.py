"""Storage tiers below a worker's own KV pool: L2 host DRAM, L3 local disk, L4 Redis.

Torch-free: payloads are bytes. See base.py for the contract, tiered.py for how the tiers
stack, config.py for building a store from settings.
"""

from pdserve.kvstore.base import EntryError, EntryFormat, KVTier, TierStats
from pdserve.kvstore.config import KVStoreConfig, build_tiered_store
from pdserve.kvstore.tiered import TieredStore

__all__ = [
    "EntryError",
    "EntryFormat",
    "KVStoreConfig",
    "KVTier",
    "TierStats",
    "TieredStore",
    "build_tiered_store",
]
