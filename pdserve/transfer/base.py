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
backend's data path is a ``BlockWriter`` (``shm.py``, ``tcp.py``) given a ``WriteContext``.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.transfer import wire
from pdserve.transfer.layout import KVLayout

if TYPE_CHECKING:  # type names only: this module stays torch-free
    import torch

    from pdserve.transfer.bandwidth import TokenBucket
    from pdserve.transfer.buffers import BufferPool
    from pdserve.transfer.peer import PeerConnection


class TransferStatus(enum.Enum):
    """Per-request state on either end. DONE and FAILED are terminal."""

    WAITING = "waiting"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"


TERMINAL = (TransferStatus.DONE, TransferStatus.FAILED)
Finished = tuple[str, TransferStatus, "str | None"]
Run = tuple[int, int, int]  # (src_start, dst_start, num_blocks), see layout.coalesce_runs


@dataclass(frozen=True)
class WriteContext:
    """Everything a ``BlockWriter`` needs to move one sender's blocks to one receiver.

    The sender builds one per connection; writers read nothing else of the sender's.
    """

    kv: torch.Tensor  # the sender's pool: the source of every write
    layout: KVLayout
    conn: PeerConnection  # authenticated, hello exchanged; sends frames, asks for leases
    remote_kv: torch.Tensor | None  # the receiver's pool mapped here (shm), else None
    max_frame_bytes: int  # the receiver's staging buffer: the largest payload it takes
    chunk_bytes: int  # pacing and frame granularity (>= one block)
    bucket: TokenBucket | None  # the bandwidth cap, shared by all of the sender's peers
    staging: BufferPool | None  # stage source bytes here first (kv not in host memory)
    checksum: bool | None  # crc32 per write; None: the backend's default
    stopped: Callable[[str], bool]  # the request ended (failed, aborted) or the sender closes
    account: Callable[[str, int, int, int], None]  # (request_id, writes, frames, nbytes)


class BlockWriter(ABC):
    """One backend's data path from a sender to one receiver, over one connection.

    The sender calls ``write`` and ``finish`` from that receiver's worker thread only, so
    calls never overlap, in the order the engine sent. ``write`` copies ``runs`` of each of
    ``layers`` into the receiver's reserved blocks and counts through ``ctx.account`` (one
    write per run per layer, one frame per ``data`` frame, payload bytes); it returns early
    once ``ctx.stopped(request_id)``, and raises TransferError or OSError to fail the
    request. It must never write a block the receiver did not reserve for the request.
    """

    name: str  # the backend, as in registry.BACKENDS

    def __init__(self, ctx: WriteContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def write(self, request_id: str, layers: list[int], runs: list[Run]) -> None:
        """Move the blocks of one ``send()``; returns once every byte is copied or handed to
        the socket."""

    def finish(self, request_id: str, num_frames: int, meta: dict[str, Any] | None) -> None:
        """Tell the receiver the request is complete after ``num_frames`` data frames (with
        the last send's ``meta``); its ACK (or FAILED) arrives later on the connection's
        reader thread."""
        header = {"type": wire.DONE, "request_id": request_id, "num_frames": num_frames}
        self.ctx.conn.send({**header, "meta": meta} if meta else header)
