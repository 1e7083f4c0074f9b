"""HostTier (L2) and DiskTier (L3): round trip, LRU and capacity, damaged and foreign files,
sharing between processes and surviving a restart."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from pdserve.kvstore.host import DiskTier, HostTier
from tests.kvstore.conftest import entry_bytes, payload

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["host", "disk"])
def make_tier(request, fmt, host_root, tmp_path):
    def make(num_entries: int, **kwargs):
        capacity = num_entries * entry_bytes(fmt)
        if request.param == "host":
            return HostTier(fmt, capacity, root=host_root, **kwargs)
        return DiskTier(fmt, tmp_path / "disk", capacity, **kwargs)

    return make


def recording(tier) -> list[int]:
    evicted: list[int] = []
    tier.on_evict = lambda h, p: evicted.append(h) if p == payload(h) else None
    return evicted


def test_round_trip(make_tier):
    tier = make_tier(4)
    assert tier.get(1) is None and not tier.contains(1)
    assert tier.put(1, payload(1)) and tier.put(2, memoryview(payload(2)))
    assert tier.get(1) == payload(1) and tier.get(2) == payload(2) and tier.contains(2)
    assert tier.put(1, payload(1))  # re-put of a stored block: a recency refresh
    assert tier.delete(1) and not tier.delete(1) and tier.get(1) is None
    stats = tier.stats()
    assert (stats["hits"], stats["misses"], stats["num_entries"]) == (2, 2, 1)
    assert stats["bytes_read"] == 2 * len(payload(1))


def test_lru_eviction_order_and_capacity(make_tier, fmt):
    tier = make_tier(3)
    evicted = recording(tier)
    for h in (1, 2, 3):
        tier.put(h, payload(h))
    assert tier.get(1) == payload(1)  # 2 is now least recently used
    tier.put(4, payload(4))
    tier.put(5, payload(5))
    assert evicted == [2, 3]
    assert [tier.contains(h) for h in (1, 2, 3, 4, 5)] == [True, False, False, True, True]
    files = [p for p in tier.directory.iterdir() if p.suffix == ".kv"]
    assert sum(p.stat().st_size for p in files) <= tier.capacity_bytes == 3 * entry_bytes(fmt)
    assert tier.stats()["evictions"] == 2


def test_too_big_put_is_refused(make_tier):
    tier = make_tier(1)
    assert not tier.put(1, payload(1) * 2)
    assert tier.stats()["rejected_puts"] == 1 and not tier.contains(1)


def test_corrupt_and_truncated_files_are_counted_misses(make_tier):
    tier = make_tier(4)
    for h in (1, 2, 3):
        tier.put(h, payload(h))
    flipped = tier.directory / f"{1:016x}.kv"
    data = bytearray(flipped.read_bytes())
    data[-100] ^= 0xFF
    flipped.write_bytes(data)
    truncated = tier.directory / f"{2:016x}.kv"
    os.truncate(truncated, truncated.stat().st_size // 2)
    os.replace(tier.directory / f"{3:016x}.kv", tier.directory / f"{4:016x}.kv")  # wrong name
    assert tier.get(1) is None and tier.get(2) is None and tier.get(4) is None
    assert not flipped.exists() and not truncated.exists()  # corrupt entries are deleted
    stats = tier.stats()
    assert (stats["corrupt"], stats["misses"], stats["hits"]) == (3, 3, 0)


def test_foreign_entry_is_a_counted_miss_and_kept(fmt, host_root):
    ours = HostTier(fmt, 10 * entry_bytes(fmt), namespace="shared", root=host_root)
    theirs = HostTier(replace(fmt, dtype="bfloat16"), 10**6, namespace="shared", root=host_root)
    block = payload(1)[: theirs.fmt.payload_bytes]  # a bfloat16 block is half as big
    theirs.put(1, block)
    assert ours.get(1) is None and ours.stats()["foreign"] == 1
    assert theirs.get(1) == block


def run_child(code: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout


CHILD_PRELUDE = """
    from pdserve.kvstore.base import EntryFormat
    from pdserve.kvstore.host import HostTier
    from tests.kvstore.conftest import KEY, payload
    fmt = EntryFormat("test/tiny-llama", 2, 2, 4, 8, "float32", key=KEY)
    tier = HostTier(fmt, {capacity}, root={root!r})
"""


def test_host_tier_is_shared_between_processes(fmt, host_root):
    capacity = 3 * entry_bytes(fmt)
    tier = HostTier(fmt, capacity, root=host_root, rescan_interval_s=3600)
    evicted = recording(tier)
    for h in (1, 2, 3):
        tier.put(h, payload(h))
    out = run_child(
        CHILD_PRELUDE.format(capacity=capacity, root=str(host_root))
        + """
    print(tier.get(1) == payload(1), tier.get(2) == payload(2))
    """
    )
    assert out.split() == ["True", "True"]
    # The child's reads made 1 and 2 recent; our index still says 1 is oldest, and the
    # mtime check on the victim corrects it without a rescan.
    tier.put(4, payload(4))
    assert evicted == [3]


def test_host_capacity_counts_other_processes_entries(fmt, host_root):
    capacity = 3 * entry_bytes(fmt)
    tier = HostTier(fmt, capacity, root=host_root, rescan_interval_s=0)
    run_child(
        CHILD_PRELUDE.format(capacity=capacity, root=str(host_root))
        + """
    for h in (11, 12, 13):
        tier.put(h, payload(h))
    """
    )
    assert tier.get(12) == payload(12)
    tier.put(1, payload(1))
    assert sorted(int(p.stem, 16) for p in tier.directory.glob("*.kv")) == [1, 12, 13]


def test_disk_entries_survive_a_restart(fmt, tmp_path):
    capacity = 3 * entry_bytes(fmt)
    first = DiskTier(fmt, tmp_path, capacity)
    for h in (1, 2, 3):
        first.put(h, payload(h))
    first.close()
    second = DiskTier(fmt, tmp_path, capacity)
    assert second.stats()["num_entries"] == 3 and second.stats()["used_bytes"] == capacity
    assert second.get(1) == payload(1)
    evicted = recording(second)
    second.put(4, payload(4))  # capacity includes what the previous process left
    assert evicted == [2]


def test_stale_temp_files_are_cleaned_on_scan(fmt, host_root):
    tier = HostTier(fmt, 10 * entry_bytes(fmt), root=host_root)
    stale = tier.directory / ".tmp-1-1-0000000000000001"
    stale.write_bytes(b"half")
    os.utime(stale, (0, 0))
    HostTier(fmt, 10 * entry_bytes(fmt), root=host_root)
    assert not stale.exists()


def test_entries_are_private_to_the_user_whatever_the_umask(make_tier):
    tier = make_tier(4)
    old = os.umask(0o022)  # the usual umask: open() would create 0644
    try:
        assert tier.put(1, payload(1))
    finally:
        os.umask(old)
    [entry] = [p for p in tier.directory.iterdir() if p.suffix == ".kv"]
    assert entry.stat().st_mode & 0o777 == 0o600
    assert tier.directory.stat().st_mode & 0o777 == 0o700
