"""A stack of tiers (L2 host, L3 disk, L4 Redis) behind one put/get, with write-down and
promotion (docs/tiers.md).

    put ──> tiers[0] ──evict──> tiers[1] ──evict──> tiers[2]      (write-down)
    get <── first tier that has it; a hit below tiers[0] is copied into tiers[0] (promotion)

Copies are inclusive. A tier that raises is skipped like a miss and counted. With
`async_puts` puts and promotions go through a bounded queue to one writer thread (a full
queue drops the put, counted); queued blocks stay readable from `_pending`.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Sequence
from functools import partial

from pdserve.kvstore.base import KVTier, Payload

log = logging.getLogger(__name__)


class TieredStore:
    def __init__(
        self, tiers: Sequence[KVTier], async_puts: bool = True, queue_size: int = 256
    ) -> None:
        if not tiers:
            raise ValueError("TieredStore needs at least one tier")
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        self.tiers = list(tiers)
        for i, tier in enumerate(self.tiers[:-1]):
            tier.on_evict = partial(self._move, i, i + 1)  # write-down
        self._lock = threading.Lock()
        self._moved_bytes: Counter[str] = Counter()  # "host->disk" -> bytes
        self._tier_errors = [0] * len(self.tiers)
        self._pending: dict[int, bytes] = {}
        self._num_inflight = 0
        self._idle = threading.Condition(self._lock)
        self._dropped_puts = 0
        self._pending_hits = 0
        self._queue: queue.Queue[tuple[int | None, int, bytes] | None] = queue.Queue(queue_size)
        self._writer: threading.Thread | None = None
        if async_puts:
            self._writer = threading.Thread(
                target=self._write_loop, name="kvstore-writer", daemon=True
            )
            self._writer.start()

    def put(self, block_hash: int, payload: Payload) -> bool:
        """Store a block in the first tier that takes it. Async: True once queued (the payload
        is copied, so the caller may reuse its buffer), False when the queue is full."""
        if self._writer is None:
            return self._store(block_hash, bytes(payload))
        return self._enqueue(None, block_hash, bytes(payload))

    def get(self, block_hash: int) -> bytes | None:
        """The payload from the highest tier holding it, or None; never raises."""
        with self._lock:
            pending = self._pending.get(block_hash)
            if pending is not None:
                self._pending_hits += 1
                return pending
        for i in range(len(self.tiers)):
            payload = self._call(i, "get", None, block_hash)
            if payload is not None:
                if i > 0:
                    self._promote(i, block_hash, payload)
                return payload
        return None

    def get_prefix(self, block_hashes: Sequence[int]) -> list[bytes]:
        """Payloads of the longest stored prefix of a chain of block hashes (stops at the
        first miss: a block after a missing one cannot be used without it)."""
        payloads = []
        for block_hash in block_hashes:
            payload = self.get(block_hash)
            if payload is None:
                break
            payloads.append(payload)
        return payloads

    def contains(self, block_hash: int) -> bool:
        with self._lock:
            if block_hash in self._pending:
                return True
        return any(self._call(i, "contains", False, block_hash) for i in range(len(self.tiers)))

    def delete(self, block_hash: int) -> None:
        for i in range(len(self.tiers)):
            self._call(i, "delete", False, block_hash)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until queued puts and promotions are written; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._num_inflight, timeout_s)

    def stats(self) -> dict:
        tiers = []
        for i, tier in enumerate(self.tiers):
            tier_stats = self._call(i, "stats", {"name": tier.name})
            with self._lock:
                tier_stats["store_errors"] = self._tier_errors[i]
            tiers.append(tier_stats)
        with self._lock:
            return {
                "tiers": tiers,
                "moved_bytes": dict(self._moved_bytes),
                "dropped_puts": self._dropped_puts,
                "pending": len(self._pending),
                "pending_hits": self._pending_hits,
            }

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (up to `timeout_s`), stop the writer, close every tier."""
        if self._writer is not None:
            self.flush(timeout_s)
            self._queue.put(None)
            self._writer.join(timeout_s)
            self._writer = None
        for i in range(len(self.tiers)):
            self._call(i, "close", None)

    def _store(self, block_hash: int, payload: bytes) -> bool:
        # tiers[0] first; a tier that refuses (too big, full, down) passes it further down
        return any(self._call(i, "put", False, block_hash, payload) for i in range(len(self.tiers)))

    def _move(self, src: int, dst: int, block_hash: int, payload: bytes) -> None:
        """Copy a block of tiers[src] into tiers[dst], counted once stored. As a write-down
        (on_evict) it runs in whichever thread made tiers[src] evict."""
        if self._call(dst, "put", False, block_hash, payload):
            with self._lock:
                self._moved_bytes[f"{self.tiers[src].name}->{self.tiers[dst].name}"] += len(payload)

    def _promote(self, src: int, block_hash: int, payload: bytes) -> None:
        if self._writer is not None:
            self._enqueue(src, block_hash, payload)
        else:
            self._move(src, 0, block_hash, payload)

    def _enqueue(self, src: int | None, block_hash: int, payload: bytes) -> bool:
        with self._lock:
            try:
                self._queue.put_nowait((src, block_hash, payload))
            except queue.Full:
                self._dropped_puts += 1
                return False
            self._pending[block_hash] = payload
            self._num_inflight += 1
        return True

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            src, block_hash, payload = item
            try:
                if src is None:
                    self._store(block_hash, payload)
                else:
                    self._move(src, 0, block_hash, payload)
            finally:
                with self._lock:
                    if self._pending.get(block_hash) is payload:  # not re-queued since
                        del self._pending[block_hash]
                    self._num_inflight -= 1
                    self._idle.notify_all()

    def _call(self, i: int, method: str, default, *args):
        """tiers[i].method(*args), or `default` if it raises: a broken tier is a miss."""
        try:
            return getattr(self.tiers[i], method)(*args)
        except Exception:
            with self._lock:
                self._tier_errors[i] += 1
                first = self._tier_errors[i] == 1
            if first:
                log.exception("kvstore tier %s: %s failed", self.tiers[i].name, method)
            return default
