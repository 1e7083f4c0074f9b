"""The store's key and directories (kvstore/keys.py): owner-only, refused when another user
made them or others may write into them, with messages naming the setting."""

from __future__ import annotations

import os
import stat
from dataclasses import replace

import pytest

from pdserve.kvstore import keys
from pdserve.kvstore.base import EntryFormat
from pdserve.kvstore.config import KVStoreConfig, build_tiered_store
from tests.kvstore.conftest import payload

FMT = EntryFormat("test/tiny-llama", 2, 2, 4, 8, "float32")  # no key: the store supplies it


def key_file(path, data: bytes = b"k" * 32, mode: int = 0o600) -> str:
    path.write_bytes(data)
    path.chmod(mode)
    return str(path)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_tier_directories_are_created_owner_only(tmp_path) -> None:
    config = KVStoreConfig(
        host_bytes=1 << 20,
        host_root=str(tmp_path / "shm"),
        disk_dir=str(tmp_path / "disk"),
        disk_bytes=1 << 20,
        key_file=key_file(tmp_path / "key"),
        async_puts=False,
    )
    store = build_tiered_store(config, FMT)
    assert [mode(t.directory) for t in store.tiers] == [0o700, 0o700]
    store.close()


def test_our_own_loose_directory_is_tightened(tmp_path) -> None:
    directory = tmp_path / "kv"
    directory.mkdir(mode=0o755)
    directory.chmod(0o755)
    keys.private_dir(directory)
    assert mode(directory) == 0o700


@pytest.mark.parametrize("setting", ["host_root", "disk_dir"])
def test_directory_others_may_write_is_refused(tmp_path, setting) -> None:
    root = tmp_path / "root"
    tier_dir = root / (f"pdserve-kv-{FMT.namespace}" if setting == "host_root" else FMT.namespace)
    tier_dir.mkdir(parents=True)
    tier_dir.chmod(0o777)
    config = (
        KVStoreConfig(host_bytes=1 << 20, host_root=str(root))
        if setting == "host_root"
        else KVStoreConfig(disk_dir=str(root), disk_bytes=1 << 20)
    )
    config = replace(config, key_file=key_file(tmp_path / "key"))
    with pytest.raises(ValueError, match=rf"kvstore.{setting} .*mode 777: others may write"):
        build_tiered_store(config, FMT)


def test_directory_another_user_made_is_refused(tmp_path) -> None:
    if os.geteuid() != 0:
        pytest.skip("making a directory owned by another user needs root")
    tier_dir = tmp_path / f"pdserve-kv-{FMT.namespace}"
    tier_dir.mkdir(mode=0o700)
    os.chown(tier_dir, 65534, 65534)
    config = KVStoreConfig(
        host_bytes=1 << 20, host_root=str(tmp_path), key_file=key_file(tmp_path / "key")
    )
    with pytest.raises(ValueError, match=r"kvstore.host_root .*created by uid 65534"):
        build_tiered_store(config, FMT)


@pytest.mark.parametrize(
    "data, file_mode, problem",
    [(b"k" * 32, 0o644, "mode 644"), (b"short", 0o600, "holds 5 bytes; it needs >= 32")],
)
def test_key_file_must_be_private_and_long_enough(tmp_path, data, file_mode, problem) -> None:
    config = KVStoreConfig(
        disk_dir=str(tmp_path / "disk"),
        disk_bytes=1 << 20,
        key_file=key_file(tmp_path / "key", data, file_mode),
    )
    with pytest.raises(ValueError, match=rf"kvstore.key_file is not usable: .*{problem}"):
        build_tiered_store(config, FMT)


def test_default_key_is_made_once_owner_only(tmp_path) -> None:
    path = tmp_path / "cfg" / "pdserve" / "kv-tier.key"
    first = keys.default_key(path)
    assert len(first) == keys.KEY_BYTES and keys.default_key(path) == first
    assert mode(path) == 0o600 and mode(path.parent) == 0o700
    assert sorted(os.listdir(path.parent)) == ["kv-tier.key"]  # no temporary file left


def test_stores_share_entries_only_with_the_same_key(tmp_path) -> None:
    def store(key_path):
        config = KVStoreConfig(
            disk_dir=str(tmp_path / "disk"),
            disk_bytes=1 << 20,
            key_file=str(key_path),
            async_puts=False,
        )
        return build_tiered_store(config, FMT)

    a = store(key_file(tmp_path / "a", b"a" * 32))
    same = store(tmp_path / "a")
    other = store(key_file(tmp_path / "b", b"b" * 32))
    assert a.put(5, payload(5))
    assert same.get(5) == payload(5)
    assert other.get(5) is None
    for s in (a, same, other):
        s.close()
