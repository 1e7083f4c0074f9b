"""The receiver's reservation table: which blocks each request may write, and its status.

Torch-free state machine; ``receiver.py`` moves the bytes. Every write into KV memory
happens while holding its reservation's ``cond`` after ``live`` was re-checked, and
``release`` takes the same lock, so once ``release`` returns no write can land (the
invariant aborts rely on).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from pdserve.transfer.base import TERMINAL, Finished, TransferStatus
from pdserve.transfer.layout import KVLayout, check_ids


@dataclass(eq=False)
class Reservation:
    request_id: str
    block_ids: list[int]
    block_set: frozenset[int]
    status: TransferStatus = TransferStatus.WAITING
    error: str | None = None
    num_frames: int = 0
    num_bytes: int = 0
    active_leases: int = 0  # shm writers granted and not yet proven finished
    holders: set[Any] = field(default_factory=set)  # connections granted a lease
    released: bool = False
    meta: dict[str, Any] = field(default_factory=dict)  # from the sender's last send
    cond: threading.Condition = field(default_factory=threading.Condition)

    @property
    def live(self) -> bool:
        """True while writes may still land."""
        return not self.released and self.status not in TERMINAL


class ReservationTable:
    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self._lock = threading.Lock()
        self._requests: dict[str, Reservation] = {}
        self._finished: list[Finished] = []

    def expect(self, request_id: str, block_ids: list[int]) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        ids = list(block_ids)
        check_ids(f"the reservation of {request_id!r}", ids, self.layout.num_blocks)
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request {request_id!r} already has a reservation")
            self._requests[request_id] = Reservation(request_id, ids, frozenset(ids))

    def get(self, request_id: str) -> Reservation | None:
        with self._lock:
            return self._requests.get(request_id)

    def status(self, request_id: str) -> TransferStatus:
        req = self.get(request_id)
        if req is None:
            raise KeyError(f"no reservation for request {request_id!r}")
        return req.status

    def meta(self, request_id: str) -> dict[str, Any]:
        req = self.get(request_id)
        if req is None or req.status is not TransferStatus.DONE:
            raise KeyError(f"no finished transfer for request {request_id!r}")
        return req.meta

    def check_write(
        self, request_id: str, layer: int, dst_start: int, num_blocks: int
    ) -> tuple[Reservation | None, str | None]:
        """The reservation and None if the write is allowed now, else an error message."""
        req = self.get(request_id)
        if req is None:
            return None, f"no reservation for request {request_id!r} (unknown or released)"
        if not req.live:
            return req, f"request {request_id!r} is {req.status.value}; write rejected"
        if not 0 <= layer < self.layout.num_layers:
            return req, f"layer {layer} outside 0..{self.layout.num_layers - 1}"
        if num_blocks <= 0:
            return req, f"empty write (num_blocks={num_blocks})"
        end = dst_start + num_blocks
        outside = [b for b in range(dst_start, end) if b not in req.block_set]
        if outside:
            return req, (
                f"write to blocks {dst_start}..{end - 1} of layer {layer} is outside the "
                f"reservation of request {request_id!r} (blocks {outside[:8]} not reserved)"
            )
        return req, None

    def mark_transferring(self, req: Reservation, nbytes: int) -> None:
        """Count one applied frame; caller holds ``req.cond`` and checked ``req.live``."""
        req.num_frames += 1
        req.num_bytes += nbytes
        req.status = TransferStatus.TRANSFERRING

    def fail(self, req: Reservation, error: str) -> bool:
        """Move a live request to FAILED; False if it was already terminal or released."""
        with req.cond:
            if not req.live:
                return False
            req.status, req.error = TransferStatus.FAILED, error
            req.cond.notify_all()
        with self._lock:
            self._finished.append((req.request_id, TransferStatus.FAILED, error))
        return True

    def finish(self, req: Reservation, num_frames: int, meta: Any = None) -> str | None:
        """Mark DONE after the sender's last frame, keeping what it carried (`meta`); an
        error message if that is not right."""
        with req.cond:
            if not req.live:
                return f"request {req.request_id!r} is not live ({req.status.value})"
            if req.active_leases:
                return f"request {req.request_id!r} finished while a shm write is in flight"
            if num_frames != req.num_frames:
                return (
                    f"request {req.request_id!r}: sender sent {num_frames} frames, "
                    f"{req.num_frames} arrived"
                )
            if not isinstance(meta, dict | None):
                return f"request {req.request_id!r}: meta must be a map, got {meta!r:.80}"
            req.status, req.meta = TransferStatus.DONE, meta or {}
        with self._lock:
            self._finished.append((req.request_id, TransferStatus.DONE, None))
        return None

    def release(self, request_id: str) -> Reservation | None:
        """Forget the reservation and mark it dead, so no lease or tcp write is admitted any
        more; returns it (None if unknown) for the caller to wait out its shm leases.

        tcp writes hold ``req.cond`` while copying, so they are excluded once this returns.
        """
        with self._lock:
            req = self._requests.pop(request_id, None)
        if req is not None:
            with req.cond:
                req.released = True
        return req

    def pop_finished(self) -> list[Finished]:
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    def __len__(self) -> int:
        with self._lock:
            return len(self._requests)
