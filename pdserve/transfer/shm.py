"""shm backend: the decode worker's KV pool in POSIX shared memory, written one-sidedly.

The receiver allocates its pool with ``create_shared_kv`` (a 0600 file in /dev/shm mapped
with ``torch.from_file(shared=True)``; a file rather than ``multiprocessing.shared_memory``
because Python < 3.13 makes every process that *opens* a segment unlink it at exit). The
sender maps it with ``open_shared_kv`` and its ``ShmWriter`` (peer.py) copies block runs
straight into it, like an RDMA write. The receiver cannot stop a process that has its memory
mapped, so writes follow a lease protocol the sender obeys and the receiver checks
(receiver.py; docs/transfer.md, "Fencing").
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import os
import re
import secrets
import stat
import threading
import time

import torch

from pdserve.transfer.layout import KVLayout

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"^pdserve-kv-[A-Za-z0-9_-]{1,64}$")
_SWEPT = re.compile(r"^pdserve-kv-lk-[0-9a-f]{12}$")  # the names create_shared_kv picks
_TMP_PREFIX = ".pdserve-kv-new-"
# data_ptr of kv tensors made by create_shared_kv -> (name, fd holding the pool's flock)
_owned: dict[int, tuple[str, int]] = {}
_owned_lock = threading.Lock()


def _path(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"invalid shm name {name!r} (expected pdserve-kv-<id>)")
    return os.path.join(SHM_DIR, name)


def _map(path: str, layout: KVLayout) -> torch.Tensor:
    numel = layout.total_bytes // layout.dtype_bytes
    flat = torch.from_file(path, shared=True, size=numel, dtype=getattr(torch, layout.dtype))
    return flat.view(layout.shape)


class ShmSpaceError(ValueError):
    """/dev/shm cannot hold the KV pool; raised at creation, never as a SIGBUS later. A
    ValueError, as a setting that does not fit: a worker's start reports it in one line."""


def _space_error(directory: str, need: int, free: int) -> ShmSpaceError:
    return ShmSpaceError(
        f"the KV pool needs {need / 2**20:.1f} MiB in {directory}, which has "
        f"{free / 2**20:.1f} MiB free; enlarge it (docker run --shm-size, or a tmpfs mount), "
        "lower cache.kv_cache_bytes, or use transfer backend 'tcp'"
    )


def _free_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def sweep_orphans(directory: str | None = None) -> list[str]:
    """Remove pools whose creating process is gone (killed before it could unlink): tmpfs
    keeps a pool in RAM until its file is deleted.

    A creator holds a shared ``flock`` on its pool for its whole life (the kernel drops it
    when the process dies, however it dies), so a pool we can lock exclusively is an
    orphan. A lock, not the pid in the name: pids are reused and differ between pid
    namespaces that share one /dev/shm. Only names ``create_shared_kv`` picks are swept, and
    temporary ones (a creator killed before publishing) once older than a minute."""
    directory = directory or SHM_DIR
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        path = os.path.join(directory, name)
        try:
            if name.startswith(_TMP_PREFIX):
                if time.time() - os.stat(path).st_mtime < 60:
                    continue  # may be between its creation and its lock
            elif not _SWEPT.match(name):
                continue
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while its creator lives
                os.unlink(path)
                removed.append(name)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def create_shared_kv(layout: KVLayout, name: str | None = None) -> tuple[torch.Tensor, str]:
    """Allocate a zeroed KV pool in /dev/shm; returns (kv, name). Unlink with
    ``unlink_shared_kv`` (the receiver's ``close`` does it).

    Every page is allocated here (``posix_fallocate``): a sparse file would take pages as
    layers are written and kill the worker with SIGBUS mid-run when tmpfs runs out (Docker's
    default /dev/shm is 64 MiB). Too little room is a ``ShmSpaceError`` naming the sizes."""
    swept = sweep_orphans()
    if swept:
        log.warning("removed %d KV pools of dead workers from %s: %s", len(swept), SHM_DIR, swept)
    name = name or f"pdserve-kv-lk-{secrets.token_hex(6)}"
    path = _path(name)
    need = layout.total_bytes
    free = _free_bytes(SHM_DIR)
    if free < need:
        raise _space_error(SHM_DIR, need, free)
    # Created under a temporary name and locked before it is published, so a sweeper never
    # sees an unlocked pool of a live creator.
    tmp = os.path.join(SHM_DIR, f"{_TMP_PREFIX}{secrets.token_hex(8)}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    where = tmp
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            os.posix_fallocate(fd, 0, need)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            raise _space_error(SHM_DIR, need, _free_bytes(SHM_DIR)) from e
        if os.path.exists(path):
            raise FileExistsError(f"shm pool {name!r} already exists")
        os.rename(tmp, path)
        where = path
        kv = _map(path, layout)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(where)
        raise
    with _owned_lock:
        _owned[kv.data_ptr()] = (name, fd)
    return kv, name


def open_shared_kv(name: str, layout: KVLayout) -> torch.Tensor:
    """Map a receiver's shared KV pool; ValueError if its size does not fit ``layout``."""
    path = _path(name)
    size = os.path.getsize(path)
    if size != layout.total_bytes:
        raise ValueError(f"shm {name!r} has {size} bytes, layout needs {layout.total_bytes}")
    return _map(path, layout)


def segment_identity(name: str) -> list[int]:
    """[device, inode] of the segment's file, which a sender compares with what it sees under
    the same name (`sees_segment`): equal only when both share this /dev/shm. A host's name and
    boot id are not enough: a container or mount namespace with its own tmpfs on /dev/shm
    shares them, but not the segment."""
    st = os.stat(_path(name))
    return [st.st_dev, st.st_ino]


@functools.lru_cache(maxsize=256)
def sees_segment(name: str, device: int, inode: int) -> bool:
    """Whether this process's /dev/shm holds the very segment a receiver offered (names are
    never reused, so a cached answer stays true)."""
    try:
        return segment_identity(name) == [device, inode]
    except (OSError, ValueError):
        return False


def shared_kv_name(kv: torch.Tensor) -> str | None:
    """The shm name of a pool made by ``create_shared_kv`` in this process, else None."""
    with _owned_lock:
        owned = _owned.get(kv.data_ptr())
    return owned[0] if owned else None


def unlink_shared_kv(name: str) -> None:
    """Remove the segment's name; memory is freed once every mapping is gone."""
    with _owned_lock:
        for ptr in [p for p, (n, _) in _owned.items() if n == name]:
            os.close(_owned.pop(ptr)[1])
    try:
        os.unlink(_path(name))
    except FileNotFoundError:
        pass
