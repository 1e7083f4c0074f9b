"""File-per-block tiers: L2 host DRAM (a tmpfs directory) and L3 local disk (docs/tiers.md).

One file per block, ``<hash:016x>.kv``, holding header + payload. The directory is the only
shared state, so every worker process of a host (or every restart, for disk) sees the same
entries without a server. Writes are atomic (a temporary file renamed onto the name);
recency is the file's mtime, set on write and read hit, so LRU order is global across
processes. Each process keeps an LRU index rebuilt by a scan at most every
`rescan_interval_s` when it puts; an evictor claims its victim by renaming it, so of two
workers evicting one file only one writes it down. Between scans a directory can exceed its
capacity by what the others put meanwhile: a cache loses no correctness by it.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import OrderedDict
from pathlib import Path

from pdserve.kvstore.base import EntryError, EntryFormat, KVTier, Payload
from pdserve.kvstore.keys import private_dir

log = logging.getLogger(__name__)

_ENTRY_NAME = re.compile(r"^([0-9a-f]{16})\.kv$")
_STALE_TMP_S = 60.0  # a temp/claimed file this old belongs to a crashed process


def _owner_only(path: str, flags: int) -> int:
    """Open an entry's file readable by this user only (0600, whatever the umask), as its
    directory is (0700): the KV of other users' prompts must not be world-readable, even
    should the directory's mode be relaxed. fchmod covers a stale temp file left by a crash."""
    fd = os.open(path, flags | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)
    return fd


class FileTier(KVTier):
    """Entries as files in `directory` under a byte cap, shared by every process using it."""

    def __init__(
        self,
        name: str,
        fmt: EntryFormat,
        directory: str | Path,
        capacity_bytes: int,
        rescan_interval_s: float = 1.0,
    ) -> None:
        super().__init__(name, fmt, capacity_bytes)
        self.directory = private_dir(directory)
        self.rescan_interval_s = rescan_interval_s
        self._lock = threading.Lock()
        self._index: OrderedDict[int, tuple[int, int]] = OrderedDict()  # hash -> (size, mtime)
        self._used_bytes = 0
        self._last_scan_s = 0.0
        with self._lock:
            self._rescan_locked()

    def _path(self, block_hash: int) -> Path:
        return self.directory / f"{block_hash & 0xFFFF_FFFF_FFFF_FFFF:016x}.kv"

    def put(self, block_hash: int, payload: Payload) -> bool:
        header = self.fmt.encode_header(block_hash, payload)
        size = len(header) + memoryview(payload).nbytes
        if size > self.capacity_bytes:
            self._stats.add(rejected_puts=1)
            return False
        path = self._path(block_hash)
        now = time.time_ns()
        try:  # equal hash means equal content: refreshing recency is all a re-put needs
            os.utime(path, ns=(now, now))
            with self._lock:
                self._record_locked(block_hash, size, now)
            self._stats.add(puts=1)
            return True
        except FileNotFoundError:
            pass
        except OSError as e:
            return self._put_failed(e)
        tmp = self.directory / f".tmp-{os.getpid()}-{threading.get_ident()}-{path.stem}"
        try:
            with open(tmp, "wb", opener=_owner_only) as f:
                f.write(header)
                f.write(payload)
            os.utime(tmp, ns=(now, now))  # after close: the final flush would reset mtime
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            return self._put_failed(e)
        self._stats.add(puts=1, bytes_written=size)
        with self._lock:
            self._record_locked(block_hash, size, now)
            victims = self._pick_victims_locked()
        for victim in victims:  # file I/O and write-down outside the lock
            self._evict(victim)
        return True

    def _put_failed(self, e: OSError) -> bool:
        log.warning("%s tier: put failed in %s: %s", self.name, self.directory, e)
        self._stats.add(rejected_puts=1, errors=1)
        return False

    def get(self, block_hash: int) -> bytes | None:
        path = self._path(block_hash)
        try:
            with open(path, "rb") as f:
                # At most one byte more than an entry: a huge file costs no memory, and a
                # wrong size fails the decode (after its header says whether it is foreign).
                data = f.read(self.fmt.entry_bytes + 1)
        except FileNotFoundError:
            self._forget(block_hash)
            self._stats.add(misses=1)
            return None
        except OSError as e:
            log.warning("%s tier: read of %s failed: %s", self.name, path, e)
            self._stats.add(misses=1, errors=1)
            return None
        payload = self._decode(block_hash, data)
        if payload is None:
            return None
        now = time.time_ns()
        try:
            os.utime(path, ns=(now, now))
        except OSError:
            pass  # evicted since we opened it; the payload we read is still whole
        with self._lock:
            self._record_locked(block_hash, len(data), now)
        return payload

    def contains(self, block_hash: int) -> bool:
        return self._path(block_hash).exists()

    def delete(self, block_hash: int) -> bool:
        try:
            self._path(block_hash).unlink()
            removed = True
        except OSError:
            removed = False
        self._forget(block_hash)
        return removed

    def stats(self) -> dict[str, int | float | str]:
        with self._lock:
            used, num_entries = self._used_bytes, len(self._index)
        return {
            **super().stats(),
            "used_bytes": used,
            "num_entries": num_entries,
            "directory": str(self.directory),
        }

    def _record_locked(self, block_hash: int, size: int, mtime_ns: int) -> None:
        old = self._index.pop(block_hash, None)
        self._used_bytes += size - (old[0] if old else 0)
        self._index[block_hash] = (size, mtime_ns)

    def _forget(self, block_hash: int) -> None:
        with self._lock:
            old = self._index.pop(block_hash, None)
            if old:
                self._used_bytes -= old[0]

    def _pick_victims_locked(self) -> list[int]:
        """Hashes to evict, least recently used first, until the directory fits again."""
        if time.monotonic() - self._last_scan_s > self.rescan_interval_s:
            self._rescan_locked()
        victims = []
        rechecked: set[int] = set()
        while self._used_bytes > self.capacity_bytes and self._index:
            block_hash, (size, mtime_ns) = next(iter(self._index.items()))
            try:
                st = self._path(block_hash).stat()
            except OSError:  # another worker evicted or deleted it
                self._index.popitem(last=False)
                self._used_bytes -= size
                continue
            if st.st_mtime_ns > mtime_ns and block_hash not in rechecked:
                rechecked.add(block_hash)  # used by another worker since our scan: keep
                self._record_locked(block_hash, st.st_size, st.st_mtime_ns)
                continue
            self._index.popitem(last=False)
            self._used_bytes -= size
            victims.append(block_hash)
        return victims

    def _evict(self, block_hash: int) -> None:
        path = self._path(block_hash)
        claimed = self.directory / f".evict-{os.getpid()}-{threading.get_ident()}-{path.stem}"
        try:
            os.rename(path, claimed)  # atomic claim: a concurrent evictor gets ENOENT
        except OSError:
            return
        try:
            data = None
            if self.on_evict is not None:
                with open(claimed, "rb") as f:
                    data = f.read(self.fmt.entry_bytes + 1)
            claimed.unlink()
        except OSError as e:
            log.warning("%s tier: eviction of %s failed: %s", self.name, path, e)
            self._stats.add(errors=1)
            return
        self._stats.add(evictions=1)
        if data is None:
            return
        try:
            payload = self.fmt.decode(block_hash, data)
        except EntryError as e:
            self._stats.add(**{e.kind: 1})
            return
        self.on_evict(block_hash, payload)

    def _rescan_locked(self) -> None:
        """Rebuild the index from the directory, oldest mtime first; drop stale temp files."""
        entries = []
        now_s = time.time()
        try:
            with os.scandir(self.directory) as it:
                for entry in it:
                    try:
                        st = entry.stat()
                    except OSError:
                        continue
                    match = _ENTRY_NAME.match(entry.name)
                    if match:
                        entries.append((st.st_mtime_ns, int(match.group(1), 16), st.st_size))
                    elif entry.name.startswith((".tmp-", ".evict-")):
                        if now_s - st.st_mtime > _STALE_TMP_S:
                            Path(entry.path).unlink(missing_ok=True)
        except OSError as e:
            log.warning("%s tier: scan of %s failed: %s", self.name, self.directory, e)
            self._stats.add(errors=1)
            return
        entries.sort()
        self._index = OrderedDict((h, (size, mtime)) for mtime, h, size in entries)
        self._used_bytes = sum(size for _, _, size in entries)
        self._last_scan_s = time.monotonic()


class HostTier(FileTier):
    """L2: host DRAM shared by all workers of a host, as files on tmpfs under
    ``<root>/pdserve-kv-<namespace>`` (by default the entry format's, so models never share or
    evict each other's blocks); they outlive the workers until evicted or the host reboots."""

    def __init__(
        self,
        fmt: EntryFormat,
        capacity_bytes: int,
        namespace: str | None = None,
        root: str | Path = "/dev/shm",
        rescan_interval_s: float = 1.0,
    ) -> None:
        directory = Path(root) / f"pdserve-kv-{namespace or fmt.namespace}"
        super().__init__("host", fmt, directory, capacity_bytes, rescan_interval_s)


class DiskTier(FileTier):
    """L3: a byte-capped directory on local disk that survives worker restarts; entries under
    ``<directory>/<namespace>``, so one disk_dir can serve several models. A new process
    scans the directory on construction, so entries written before a restart are found and
    counted against capacity. No fsync: this is a cache, and a torn file fails its MAC."""

    def __init__(
        self,
        fmt: EntryFormat,
        directory: str | Path,
        capacity_bytes: int,
        namespace: str | None = None,
        rescan_interval_s: float = 1.0,
    ) -> None:
        path = Path(directory) / (namespace or fmt.namespace)
        super().__init__("disk", fmt, path, capacity_bytes, rescan_interval_s)
