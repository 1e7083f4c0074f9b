"""Layout, coalescing, bandwidth parsing, token bucket and buffer pool on their own."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest

from pdserve.transfer import make_receiver
from pdserve.transfer.layout import KVLayout, coalesce_runs
from pdserve.transfer.limits import BufferPool, TokenBucket, parse_bandwidth
from tests.transfer.conftest import LAYOUT, SECRET, random_kv


def test_layout_sizes_and_msgpack_roundtrip() -> None:
    assert LAYOUT.block_bytes == 2 * 16 * 2 * 8 * 4
    assert LAYOUT.shape == (4, 32, 2, 2, 16, 8)  # layers, blocks, K|V, kv heads, block, dim
    wire = msgpack.unpackb(msgpack.packb(LAYOUT.to_dict()))
    assert KVLayout.from_dict(wire) == LAYOUT
    smollm = KVLayout(30, 1, 16, 3, 64)
    assert smollm.block_bytes * 30 // 16 == 46080  # ~45 KB of KV per token


def test_layout_rejects_bad_fields() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        KVLayout(4, 0, 16, 2, 8)
    with pytest.raises(ValueError, match="dtype"):
        KVLayout(4, 8, 16, 2, 8, dtype="float64x")
    with pytest.raises(ValueError, match="bad KVLayout"):
        KVLayout.from_dict({"num_layers": 1})


def test_layout_from_tensor_matches() -> None:
    assert KVLayout.from_tensor(random_kv()) == LAYOUT


@pytest.mark.parametrize(
    "src, dst, runs",
    [
        ([0, 1, 2], [5, 6, 7], [(0, 5, 3)]),
        ([2, 0, 1], [7, 5, 6], [(0, 5, 3)]),  # out of order still coalesces
        ([0, 1, 2], [5, 6, 9], [(0, 5, 2), (2, 9, 1)]),
        ([0, 2, 3], [5, 6, 7], [(0, 5, 1), (2, 6, 2)]),
        ([], [], []),
    ],
)
def test_coalesce_runs(src, dst, runs) -> None:
    assert coalesce_runs(src, dst) == runs


@pytest.mark.parametrize(
    "text, bps",
    [
        ("10Gbit", 10e9),
        ("100 Mbit", 100e6),
        ("1.5GB", 12e9),
        ("2MB/s", 16e6),
        ("5Kbit", 5e3),
        ("1gbps", 1e9),
        (2.5e9, 2.5e9),
        (None, None),
    ],
)
def test_parse_bandwidth(text, bps) -> None:
    assert parse_bandwidth(text) == bps


@pytest.mark.parametrize("text", ["10", "fast", "10 Gbitz", "-1Gbit", "0MB", ""])
def test_parse_bandwidth_errors_name_the_value(text) -> None:
    with pytest.raises(ValueError, match="bandwidth"):
        parse_bandwidth(text)


def test_token_bucket_rate_is_a_lower_bound() -> None:
    bucket = TokenBucket(rate_bps=8e6, burst_bits=0)  # 1 MB/s
    start = time.monotonic()
    for _ in range(10):
        bucket.consume(8 * 10_000)
    assert time.monotonic() - start >= 0.1 * 0.95


def test_buffer_pool_waits_instead_of_allocating() -> None:
    pool = BufferPool(pool_bytes=2048, buffer_bytes=1024)
    a, b = pool.acquire(), pool.acquire()
    with pytest.raises(TimeoutError):
        pool.acquire(timeout_s=0.01)
    threading.Timer(0.05, pool.release, args=(a,)).start()
    c = pool.acquire(timeout_s=5.0)
    assert c.data_ptr() == a.data_ptr()  # the same pre-allocated buffer came back
    pool.release(b)
    pool.release(c)
    assert pool.stats()["max_in_use"] == 2


def test_registry_rejects_unknown_backend_and_shm_without_shared_kv() -> None:
    with pytest.raises(ValueError, match="choose one of"):
        make_receiver("rdma", random_kv(), LAYOUT, SECRET)
    with pytest.raises(ValueError, match="create_shared_kv"):
        make_receiver("shm", random_kv(), LAYOUT, SECRET)


def test_sweep_removes_only_pools_of_dead_processes(tmp_path):
    import fcntl
    import os

    from pdserve.transfer.shm import sweep_orphans

    dead = tmp_path / "pdserve-kv-lk-00000000ab12"  # nobody holds its lock
    alive = tmp_path / "pdserve-kv-lk-00000000cd34"  # its creator (here, us) holds it
    other = tmp_path / "pdserve-kv-smollm2-0011aabb"  # a host-tier name: not a pool
    for path in (dead, alive, other):
        path.write_bytes(b"x")
    fd = os.open(alive, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    assert sweep_orphans(str(tmp_path)) == [dead.name]
    os.close(fd)
    assert alive.exists() and other.exists() and not dead.exists()
