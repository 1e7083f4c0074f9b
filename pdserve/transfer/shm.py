"""shm backend: the decode worker's KV pool in POSIX shared memory, written one-sidedly.

The receiver allocates its pool with ``create_shared_kv`` (a 0600 file in /dev/shm mapped
with ``torch.from_file(shared=True)``; a file rather than ``multiprocessing.shared_memory``
because Python < 3.13 makes every process that *opens* a segment unlink it at exit). The
sender maps it with ``open_shared_kv`` and copies block runs straight into it, like an RDMA
write; the control connection is the authenticated tcp one.

Reservations with one-sided writes: the receiver cannot stop a process that has its memory
mapped, so enforcement is a protocol the sender's code obeys and the receiver checks:

1. Per ``send()``, the sender asks for a *lease* listing every (layer, dst run) it will
   write. The receiver grants it only if each run lies inside a live reservation, and
   counts the lease on the reservation under the same lock ``release`` takes.
2. The sender refuses to write any block not in the granted ids, copies in chunks (stopping
   between two once the request failed), sends one ``data`` notice (``nbytes=0,
   written=True``) per run, which the receiver re-validates (reservation, lease held,
   optional crc over its own memory), then ends the lease.
3. ``release`` marks the reservation dead (a late send gets its lease refused), tells the
   lease holders the request failed, and waits for proof that they stopped: their
   ``lease_end`` or their process's exit. Without it the blocks stay fenced (receiver.py).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import secrets
import stat
import threading
import time
import zlib

import torch

from pdserve.transfer import wire
from pdserve.transfer.base import BlockWriter, Run, WriteContext
from pdserve.transfer.buffers import block_bytes_view
from pdserve.transfer.layout import KVLayout
from pdserve.transfer.wire import TransferError

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
LEASE_TIMEOUT_S = 10.0
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


class ShmWriter(BlockWriter):
    """Writes into ``ctx.remote_kv``, the receiver's pool mapped with ``open_shared_kv``."""

    name = "shm"

    def __init__(self, ctx: WriteContext) -> None:
        if ctx.remote_kv is None:
            raise ValueError("ShmWriter needs the receiver's pool mapped (ctx.remote_kv)")
        super().__init__(ctx)
        self.remote_kv = ctx.remote_kv
        self.checksum = bool(ctx.checksum)

    def write(self, request_id: str, layers: list[int], runs: list[Run]) -> None:
        writes = [[layer, dst, n] for layer in layers for _, dst, n in runs]
        if not writes:
            return
        conn = self.ctx.conn
        granted = set(conn.request_lease(request_id, writes, LEASE_TIMEOUT_S))
        try:
            for layer in layers:
                for src_start, dst_start, num_blocks in runs:
                    if self.ctx.stopped(request_id):
                        return
                    if not granted.issuperset(range(dst_start, dst_start + num_blocks)):
                        end = dst_start + num_blocks - 1
                        raise TransferError(
                            f"refusing shm write to blocks {dst_start}..{end} of request "
                            f"{request_id!r}: not in the receiver's grant"
                        )
                    self._copy(request_id, layer, src_start, dst_start, num_blocks)
        finally:
            try:
                conn.send({"type": wire.LEASE_END, "request_id": request_id})
            except OSError:
                pass  # connection gone: the receiver ends the lease when it sees the drop

    def _copy(self, request_id: str, layer: int, src_start: int, dst_start: int, n: int) -> None:
        ctx = self.ctx
        src = block_bytes_view(ctx.kv, layer, src_start, n)
        dst = block_bytes_view(self.remote_kv, layer, dst_start, n)
        # In chunks, checking for a stop before each: a receiver that released the request
        # (its "failed" stops us) waits for our lease_end, so stop soon, and never notify
        # for a run cut short.
        for offset in range(0, src.numel(), ctx.chunk_bytes):
            if ctx.stopped(request_id):
                return
            end = min(offset + ctx.chunk_bytes, src.numel())
            if ctx.bucket is not None:
                ctx.bucket.consume(8 * (end - offset))
            dst[offset:end].copy_(src[offset:end])
        header = {
            "type": wire.DATA,
            "request_id": request_id,
            "layer": layer,
            "dst_start": dst_start,
            "num_blocks": n,
            "nbytes": 0,
            "written": True,
        }
        if self.checksum:
            header["crc32"] = zlib.crc32(src.numpy())
        ctx.conn.send(header)
        ctx.account(request_id, 1, 1, src.numel())
