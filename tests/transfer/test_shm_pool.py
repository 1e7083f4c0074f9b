"""The shm pool's life: allocated up front (a too-small /dev/shm fails at creation, never
with SIGBUS mid-run) and swept once its creator is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from pdserve.transfer import shm
from pdserve.transfer.layout import KVLayout
from pdserve.transfer.shm import ShmSpaceError, create_shared_kv, unlink_shared_kv

# 4 layers x 64 blocks x 16 KiB = 4 MiB
BIG = KVLayout(num_layers=4, num_blocks=64, block_size=16, num_kv_heads=4, head_dim=32)


@pytest.fixture
def small_shm(tmp_path, monkeypatch) -> Iterator[str]:
    """A 2 MiB tmpfs standing in for a container's /dev/shm (needs root to mount)."""
    mnt = tmp_path / "shm"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)])
    if done.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (no CAP_SYS_ADMIN?)")
    monkeypatch.setattr(shm, "SHM_DIR", str(mnt))
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_pool_larger_than_shm_fails_at_creation_naming_sizes(small_shm: str) -> None:
    with pytest.raises(ShmSpaceError, match=r"needs 4\.0 MiB in .*shm, which has 2\.0 MiB free"):
        create_shared_kv(BIG)
    assert os.listdir(small_shm) == []


def test_pool_that_free_space_misreports_fails_in_fallocate(small_shm, monkeypatch) -> None:
    """statvfs is only a first look (another process may take the room meanwhile): the
    allocation itself is what must fail, with the same message and nothing left behind."""
    monkeypatch.setattr(shm, "_free_bytes", lambda directory: 1 << 40)
    with pytest.raises(ShmSpaceError, match="needs 4.0 MiB"):
        create_shared_kv(BIG)
    assert os.listdir(small_shm) == []


def test_pool_is_allocated_not_sparse(small_shm: str) -> None:
    layout = KVLayout(num_layers=2, num_blocks=16, block_size=16, num_kv_heads=4, head_dim=32)
    kv, name = create_shared_kv(layout)
    try:
        st = os.stat(os.path.join(small_shm, name))
        assert st.st_size == layout.total_bytes
        assert st.st_blocks * 512 >= layout.total_bytes  # every page taken now
        kv.fill_(1.0)  # writing it all cannot fault
    finally:
        unlink_shared_kv(name)


def test_space_check_uses_statvfs(monkeypatch) -> None:
    """Without root: the check before allocating, on a faked statvfs."""

    class Small:
        f_bavail, f_frsize = 256, 4096  # 1 MiB

    monkeypatch.setattr(shm.os, "statvfs", lambda path: Small)
    # A ValueError: the worker's main prints those as one line and exits 2.
    with pytest.raises(ValueError, match=r"4\.0 MiB .* 1\.0 MiB free.*--shm-size"):
        create_shared_kv(BIG)


HOLDER = textwrap.dedent(
    """
    import sys, time
    from pdserve.transfer import shm
    from pdserve.transfer.layout import KVLayout
    shm.SHM_DIR = sys.argv[1]
    kv, name = shm.create_shared_kv(KVLayout(1, 4, 4, 1, 8))
    print(name, flush=True)
    time.sleep(60)
    """
)


def _holder(directory: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, directory], stdout=subprocess.PIPE, text=True
    )
    return proc, proc.stdout.readline().strip()


def test_pools_of_killed_workers_are_swept_live_ones_kept(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    dead, dead_name = _holder(str(tmp_path))
    live, live_name = _holder(str(tmp_path))
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait()
        foreign = tmp_path / "pdserve-kv-chosen-by-caller"  # not a name the sweep owns
        foreign.write_bytes(b"x")
        kv, name = create_shared_kv(KVLayout(1, 4, 4, 1, 8))
        unlink_shared_kv(name)
        assert sorted(os.listdir(tmp_path)) == sorted([live_name, foreign.name])
    finally:
        live.kill()
        live.wait()
    assert shm.sweep_orphans(str(tmp_path)) == [live_name]


def test_half_made_pools_are_swept_only_when_old_and_unlocked(tmp_path) -> None:
    """A creator killed between creating its pool and publishing it leaves a temporary
    file; one still being allocated (locked) or just made is kept."""
    import fcntl
    import time

    def temp(name: str, age_s: float) -> str:
        path = tmp_path / f"{shm._TMP_PREFIX}{name}"
        path.write_bytes(b"x")
        os.utime(path, (time.time() - age_s,) * 2)
        return str(path)

    temp("orphan", 120)
    fd = os.open(temp("allocating", 120), os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    temp("fresh", 0)
    try:
        assert shm.sweep_orphans(str(tmp_path)) == [f"{shm._TMP_PREFIX}orphan"]
    finally:
        os.close(fd)
    assert len(os.listdir(tmp_path)) == 2
