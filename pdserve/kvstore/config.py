"""Settings for the tiers below L1, and the one place that turns them into a TieredStore.

Tier modules are imported only when configured, so an engine without a KV store pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.kvstore import keys
from pdserve.kvstore.base import EntryFormat, KVTier
from pdserve.kvstore.tiered import TieredStore


@dataclass(frozen=True)
class KVStoreConfig:
    """Each tier is on when its size (or URL) is set; all off by default."""

    host_bytes: int = 0  # L2 capacity in /dev/shm, shared by the workers of a host
    host_root: str = "/dev/shm"
    disk_dir: str | None = None  # L3 directory (entries go in a per-model subdirectory)
    disk_bytes: int = 0
    redis_url: str | None = None  # L4, redis://host:port/db; capacity is Redis' maxmemory
    redis_timeout_s: float = 0.25
    redis_ttl_s: float | None = None
    async_puts: bool = True
    queue_size: int = 256
    key_file: str | None = None  # the entries' MAC key (kvstore/keys.py); None: per-user key

    def __post_init__(self) -> None:
        for name in ("host_bytes", "disk_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"kvstore.{name} must be >= 0, got {getattr(self, name)}")
        if (self.disk_dir is None) != (self.disk_bytes == 0):
            raise ValueError(
                "kvstore.disk_dir and kvstore.disk_bytes go together: set both or neither "
                f"(disk_dir={self.disk_dir!r}, disk_bytes={self.disk_bytes})"
            )
        if self.redis_url not in (None, "local") and not self.redis_url.startswith("redis://"):
            raise ValueError(f"kvstore.redis_url must start with redis://, got {self.redis_url!r}")
        if self.redis_timeout_s <= 0:
            raise ValueError(f"kvstore.redis_timeout_s must be > 0, got {self.redis_timeout_s}")
        if self.redis_ttl_s is not None and self.redis_ttl_s <= 0:
            raise ValueError(f"kvstore.redis_ttl_s must be > 0, got {self.redis_ttl_s}")
        if self.queue_size < 1:
            raise ValueError(f"kvstore.queue_size must be >= 1, got {self.queue_size}")

    @property
    def enabled(self) -> bool:
        return bool(self.host_bytes or self.disk_bytes or self.redis_url)


def build_tiered_store(config: KVStoreConfig, fmt: EntryFormat) -> TieredStore | None:
    """The configured tiers in order L2, L3, L4, or None when none is configured. A directory
    that cannot be created is a ValueError naming the setting; a Redis that is down is not an
    error (the tier degrades to misses until it comes back). So is a key file that is not
    private or too short, or a tier directory another user made or may write into."""
    if not config.enabled:
        return None
    try:
        key = keys.read_key_file(config.key_file) if config.key_file else keys.default_key()
    except (OSError, ValueError) as e:
        setting = "kvstore.key_file" if config.key_file else f"the key {keys.DEFAULT_KEY_FILE}"
        raise ValueError(f"{setting} is not usable: {e}") from e
    fmt = replace(fmt, key=key)
    tiers: list[KVTier] = []
    if config.host_bytes:
        from pdserve.kvstore.host import HostTier

        try:
            tiers.append(HostTier(fmt, config.host_bytes, root=config.host_root))
        except OSError as e:
            raise ValueError(f"kvstore.host_root {config.host_root!r} is not usable: {e}") from e
    if config.disk_dir is not None:
        from pdserve.kvstore.disk import DiskTier

        try:
            tiers.append(DiskTier(fmt, config.disk_dir, config.disk_bytes))
        except OSError as e:
            raise ValueError(f"kvstore.disk_dir {config.disk_dir!r} is not usable: {e}") from e
    if config.redis_url is not None:
        from pdserve.kvstore.redis import RedisTier

        tiers.append(RedisTier(fmt, config.redis_url, config.redis_timeout_s, config.redis_ttl_s))
    if not tiers:
        return None
    return TieredStore(tiers, async_puts=config.async_puts, queue_size=config.queue_size)
