"""L3: a byte-capped directory on local disk that survives worker restarts.

The same file-per-block store as the host tier (see host.py for atomic writes, cross-process
LRU and its limits); only the place differs. A new process scans the directory on
construction, so entries written before a restart are found and counted against capacity.
No fsync: this is a cache, and a file torn by a crash fails its MAC and is a miss.
"""

from __future__ import annotations

from pathlib import Path

from pdserve.kvstore.base import EntryFormat
from pdserve.kvstore.host import FileTier


class DiskTier(FileTier):
    """Entries under ``<directory>/<namespace>``, so one disk_dir can serve several models."""

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
