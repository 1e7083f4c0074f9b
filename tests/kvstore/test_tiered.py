"""TieredStore: write-down on eviction, promotion on a lower hit, async writer, broken tiers,
and building a store from settings."""

from __future__ import annotations

import threading

import pytest

from pdserve.kvstore.config import KVStoreConfig, build_tiered_store
from pdserve.kvstore.host import DiskTier, FileTier, HostTier
from pdserve.kvstore.tiered import TieredStore
from tests.kvstore.conftest import entry_bytes, payload


def where(store: TieredStore, block_hashes) -> list[str]:
    """Name of the highest tier holding each block ("-" for none)."""
    return [next((t.name for t in store.tiers if t.contains(h)), "-") for h in block_hashes]


@pytest.fixture
def three_tiers(fmt, host_root, tmp_path):
    """L2 and L3 of two entries each, and a roomy file tier standing in for L4."""
    size = entry_bytes(fmt)
    return [
        HostTier(fmt, 2 * size, root=host_root),
        DiskTier(fmt, tmp_path / "disk", 2 * size),
        FileTier("remote", fmt, tmp_path / "remote", 100 * size),
    ]


def test_eviction_walks_down_and_get_promotes(three_tiers, fmt):
    store = TieredStore(three_tiers, async_puts=False)
    for h in range(1, 7):
        store.put(h, payload(h))
    assert where(store, range(1, 7)) == ["remote"] * 2 + ["disk"] * 2 + ["host"] * 2
    assert store.get(1) == payload(1)  # promoted to host: 5 goes to disk, 3 to remote
    assert where(store, [1, 3, 5, 6]) == ["host", "remote", "disk", "host"]
    assert store.tiers[2].contains(3) and store.tiers[2].contains(1)  # copies are inclusive
    n = len(payload(0))
    assert store.stats()["moved_bytes"] == {
        "host->disk": 5 * n,
        "disk->remote": 3 * n,
        "remote->host": n,
    }
    assert store.get_prefix([6, 1, 5, 99, 2]) == [payload(6), payload(1), payload(5)]
    assert store.get(99) is None and not store.contains(99)
    hit_rates = [t["hit_rate"] for t in store.stats()["tiers"]]
    assert hit_rates[0] > 0 and hit_rates[2] > 0


def test_async_puts_are_readable_before_written_and_copied(three_tiers):
    store = TieredStore(three_tiers, async_puts=True)
    buf = bytearray(payload(1))
    assert store.put(1, memoryview(buf))
    buf[:] = payload(2)  # the engine reuses its buffer as soon as put returns
    assert store.get(1) == payload(1) and store.contains(1)
    assert store.flush(timeout_s=5)
    assert store.tiers[0].get(1) == payload(1) and store.stats()["pending"] == 0
    store.close()


class BlockingTier(FileTier):
    """A tier whose puts wait for a signal, to fill the writer queue deterministically."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.release = threading.Event()
        self.entered = threading.Event()

    def put(self, block_hash, payload):
        self.entered.set()
        self.release.wait(5)
        return super().put(block_hash, payload)


def test_full_queue_drops_puts(fmt, tmp_path):
    tier = BlockingTier("slow", fmt, tmp_path, 100 * entry_bytes(fmt))
    store = TieredStore([tier], async_puts=True, queue_size=1)
    assert store.put(1, payload(1))
    assert tier.entered.wait(5)  # the writer holds block 1; the queue is empty again
    assert store.put(2, payload(2))
    assert not store.put(3, payload(3))
    tier.release.set()
    assert store.flush(timeout_s=5)
    assert store.stats()["dropped_puts"] == 1
    assert [tier.contains(h) for h in (1, 2, 3)] == [True, True, False]
    store.close()


class BrokenTier(FileTier):
    def get(self, block_hash):
        raise RuntimeError("disk on fire")

    put = contains = get


def test_a_raising_tier_is_skipped(fmt, tmp_path):
    good = DiskTier(fmt, tmp_path / "good", 10 * entry_bytes(fmt))
    good.put(1, payload(1))
    store = TieredStore([BrokenTier("broken", fmt, tmp_path / "b", 10**6), good], async_puts=False)
    assert store.get(1) == payload(1)
    assert store.put(2, payload(2)) and good.contains(2)  # falls through to the next tier
    assert store.stats()["tiers"][0]["store_errors"] == 3  # get, promotion put, put


def test_build_from_settings(fmt, tmp_path):
    assert build_tiered_store(KVStoreConfig(), fmt) is None
    config = KVStoreConfig(
        host_bytes=10**6,
        host_root=str(tmp_path / "shm"),
        disk_dir=str(tmp_path / "disk"),
        disk_bytes=10**7,
        redis_url="redis://127.0.0.1:1/0",
        async_puts=False,
    )
    store = build_tiered_store(config, fmt)
    assert [t.name for t in store.tiers] == ["host", "disk", "redis"]
    assert store.put(1, payload(1)) and store.get(1) == payload(1)
    store.close()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"disk_dir": "/x"}, "disk_dir"),
        ({"host_bytes": -1}, "host_bytes"),
        ({"redis_url": "localhost:6379"}, "redis_url"),
        ({"queue_size": 0}, "queue_size"),
    ],
)
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"kvstore.{field}"):
        KVStoreConfig(**kwargs)


def test_unusable_directory_names_the_setting(fmt, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="kvstore.disk_dir"):
        build_tiered_store(KVStoreConfig(disk_dir=str(blocker), disk_bytes=10), fmt)
