"""Settings for the tiers below L1, and the one place that turns them into a TieredStore.

Tier modules are imported only when configured, so an engine without a KV store pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.kvstore import keys
from pdserve.kvstore.base import EntryFormat, KVTier
from pdserve.kvstore.tiered import TieredStore
from pdserve.schema import check, knob, parse_bytes


@dataclass(frozen=True)
class KVStoreConfig:
    """Each tier is on when its size (or URL) is set; all off by default."""

    host_bytes: int = knob(0, "L2: host DRAM (shm) tier size per host", ge=0, parse=parse_bytes)
    host_root: str = knob("/dev/shm", "L2 directory")
    disk_dir: str | None = knob(None, "L3: local disk tier directory (per-model subdirectory)")
    disk_bytes: int = knob(0, "L3 size", ge=0, parse=parse_bytes)
    redis_url: str | None = knob(
        None,
        "L4: redis://host:port/db (capacity: Redis' maxmemory), or 'local'",
        pattern=(r"local|redis://.*", "'local' or start with redis://"),
    )
    redis_timeout_s: float = knob(0.25, "L4 request timeout", gt=0)
    redis_ttl_s: float | None = knob(None, "L4 entry lifetime (default: none)", gt=0)
    async_puts: bool = knob(True, "write to the tiers from a background thread")
    queue_size: int = knob(256, "most writes waiting for that thread", ge=1)
    key_file: str | None = knob(None, "the entries' MAC key (kvstore/keys.py; default: per user)")

    def __post_init__(self) -> None:
        check(self, "kvstore.")
        if (self.disk_dir is None) != (self.disk_bytes == 0):
            raise ValueError(
                "kvstore.disk_dir and kvstore.disk_bytes go together: set both or neither "
                f"(disk_dir={self.disk_dir!r}, disk_bytes={self.disk_bytes})"
            )

    @property
    def enabled(self) -> bool:
        return bool(self.host_bytes or self.disk_bytes or self.redis_url)


def build_tiered_store(config: KVStoreConfig, fmt: EntryFormat) -> TieredStore | None:
    """The configured tiers in order L2, L3, L4, or None when none is configured. A directory
    or key file that is not usable (or not private) is a ValueError naming the setting; a
    Redis that is down is not an error (the tier degrades to misses until it comes back)."""
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
        from pdserve.kvstore.host import DiskTier

        try:
            tiers.append(DiskTier(fmt, config.disk_dir, config.disk_bytes))
        except OSError as e:
            raise ValueError(f"kvstore.disk_dir {config.disk_dir!r} is not usable: {e}") from e
    if config.redis_url is not None:
        from pdserve.kvstore.redis import RedisTier

        tiers.append(RedisTier(fmt, config.redis_url, config.redis_timeout_s, config.redis_ttl_s))
    return TieredStore(tiers, async_puts=config.async_puts, queue_size=config.queue_size)
