"""Entries are authenticated (HMAC with the store's key) and size-checked before any copy:
a planted entry, well formed or not, is a miss and never reaches a worker's pool."""

from __future__ import annotations

import os
import tracemalloc
from dataclasses import replace

import pytest

from pdserve.kvcache.hashing import hash_blocks
from pdserve.kvstore.config import KVStoreConfig
from pdserve.kvstore.host import DiskTier, HostTier
from tests.engine.test_engine import run
from tests.engine.test_kv_offload import BLOCK_SIZE, engine
from tests.kvstore.conftest import payload, redis_server  # noqa: F401  (fixture)

OTHER_KEY = b"an attacker's key, not the store's"


@pytest.fixture(params=["host", "disk", "redis"])
def tier(request, fmt, host_root, tmp_path):
    if request.param == "host":
        t = HostTier(fmt, 1 << 20, root=host_root)
    elif request.param == "disk":
        t = DiskTier(fmt, tmp_path / "disk", 1 << 20)
    else:
        from pdserve.kvstore.redis import RedisTier

        server = request.getfixturevalue("redis_server")
        t = RedisTier(fmt, server.url)
    yield t
    t.close()


def plant(tier, block_hash: int, data: bytes) -> None:
    """Write raw bytes where the tier keeps ``block_hash``, as another user could."""
    if hasattr(tier, "directory"):
        tier._path(block_hash).write_bytes(data)
    else:
        tier._client.set(tier._key(block_hash), data)


def test_well_formed_entry_made_without_the_key_is_a_miss_and_removed(tier, fmt) -> None:
    forged = replace(fmt, key=OTHER_KEY).encode(7, payload(8))  # right size, format, hash
    plant(tier, 7, forged)
    assert tier.get(7) is None
    assert tier.stats()["corrupt"] == 1 and not tier.contains(7)
    assert tier.put(7, payload(7)) and tier.get(7) == payload(7)  # the real one goes in


@pytest.mark.parametrize("num_bytes", [-1, +1, 10 << 20])
def test_entry_of_the_wrong_size_is_a_miss_read_within_bounds(tier, fmt, num_bytes) -> None:
    """Even with a valid MAC (a writer holding the key, but buggy): the payload must be one
    block of the format, and a huge value is never read whole."""
    size = fmt.payload_bytes + num_bytes if num_bytes != 10 << 20 else num_bytes
    plant(tier, 9, fmt.encode(9, os.urandom(size)))
    tracemalloc.start()
    try:
        assert tier.get(9) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert tier.stats()["corrupt"] == 1 and not tier.contains(9)
    assert peak < 256 << 10  # a few entries' worth, not the 10 MiB value


@pytest.mark.parametrize("kind", ["forged", "wrong_size"])
def test_planted_entries_never_change_outputs(tiny_model_dir, tmp_path, kind) -> None:
    """Every block of a prompt planted in the disk tier, forged (another key: it would change
    the output) or of the wrong size under the store's key (it used to crash the worker in
    the copy into its pool): the worker computes them and answers as one without tiers."""
    prompt = list(range(2, 42))  # 10 full blocks
    (reference,) = run(engine(tiny_model_dir, KVStoreConfig()), [prompt + [7, 7]])
    key_file = tmp_path / "key"
    key_file.write_bytes(os.urandom(32))
    key_file.chmod(0o600)
    store = KVStoreConfig(disk_dir=str(tmp_path / "kv"), disk_bytes=1 << 20, key_file=str(key_file))
    eng = engine(tiny_model_dir, store)
    tier = eng.offload.store.tiers[0]
    fmt, size = tier.fmt, tier.fmt.payload_bytes
    for block_hash in hash_blocks(prompt, BLOCK_SIZE, eng.kv.root_hash):
        if kind == "forged":
            plant(
                tier, block_hash, replace(fmt, key=OTHER_KEY).encode(block_hash, os.urandom(size))
            )
        else:
            plant(tier, block_hash, fmt.encode(block_hash, os.urandom(size // 2)))
    assert run(eng, [prompt + [7, 7]]) == [reference]
    assert tier.stats()["corrupt"] >= 1 and tier.stats()["hits"] == 0
