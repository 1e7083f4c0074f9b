"""The KV transfer contract between a prefill worker (sender) and a decode worker (receiver).

Flow for one request (docs/transfer.md)::

    decode worker                                  prefill worker
    rx.expect(rid, block_ids)     # reservation
    rx.address()  ──(router)──▶   tx.send(peer, rid, [l], src_ids, dst_ids, last=False)  x L
                                  ...                                 (or one send, last=True)
    rx.pop_finished() -> DONE  ◀── bytes + "done"; receiver acks ──▶  tx.pop_finished() -> DONE
    rx.meta(rid)               ◀── the last send's `meta`, with "done"
    ...decode...; rx.release(rid)                                     free / cache src blocks

Both ends are thread-safe; work happens on background threads, so the engine only polls
``pop_finished()`` once per step and never blocks on the network. Inside the sender, each
backend's data path is a ``BlockWriter`` given a ``WriteContext`` (both in ``peer.py``).
"""

from __future__ import annotations

import enum


class TransferStatus(enum.Enum):
    """Per-request state on either end. DONE and FAILED are terminal."""

    WAITING = "waiting"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"


TERMINAL = (TransferStatus.DONE, TransferStatus.FAILED)
Finished = tuple[str, TransferStatus, "str | None"]
