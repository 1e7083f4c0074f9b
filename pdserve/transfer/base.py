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


class KVReceiver(ABC):
    """Decode side: owns the destination KV tensor and admits writes only into reservations.

    Invariant: no byte reaches ``kv`` unless it belongs to a request with a live reservation
    (``expect`` called, ``release`` not yet called, not DONE/FAILED) and lands in that
    reservation's block ids. Anything else fails the request (or, for a request it does not
    know, is dropped) without touching memory.
    """

    layout: KVLayout

    @abstractmethod
    def address(self) -> dict[str, Any]:
        """Msgpack-able connection info for senders: backends, host, port, shm name, layout,
        host identity. The router carries it from the decode worker to the prefill worker."""

    @abstractmethod
    def expect(self, request_id: str, block_ids: list[int]) -> None:
        """Reserve ``block_ids`` for ``request_id``: only these may be written for it.

        Status becomes WAITING. Raises ValueError for an id already reserved or a block id
        out of range. Use a fresh request id for a retry: writes from an earlier attempt
        under the same id are indistinguishable from the new one's.
        """

    @abstractmethod
    def status(self, request_id: str) -> TransferStatus:
        """Current status; KeyError for a request never expected or already released."""

    @abstractmethod
    def pop_finished(self) -> list[Finished]:
        """Requests that became DONE or FAILED since the last call, each once, with an
        error message for FAILED. DONE means every send up to the ``last=True`` one
        landed, in order, inside the reservation."""

    @abstractmethod
    def meta(self, request_id: str) -> dict[str, Any]:
        """What the sender's ``last=True`` send carried (empty when nothing), once DONE and
        until ``release``; KeyError otherwise."""

    @abstractmethod
    def release(self, request_id: str) -> bool:
        """Forget the reservation; later writes are rejected. Releasing an unknown id is a
        no-op (True), so aborts may release unconditionally.

        True: no write for the request can touch memory any more; its blocks may be reused.
        False: a one-sided (shm) writer may still land in them, so they are *fenced*: the
        caller must keep them out of reuse until ``pop_unfenced`` lists the request."""

    @abstractmethod
    def pop_unfenced(self) -> list[str]:
        """Released requests whose fenced blocks became safe to reuse since the last call,
        each once (the engine polls it with ``pop_finished``)."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters for tests and metrics (writes, frames, bytes, rejections)."""

    @abstractmethod
    def close(self) -> None:
        """Stop accepting, drop connections, release shared memory this receiver owns."""


class KVSender(ABC):
    """Prefill side: copies blocks of its own ``kv`` into a receiver's reserved blocks.

    The caller guarantees source blocks are not modified until the request is reported
    DONE or FAILED by ``pop_finished``.
    """

    layout: KVLayout

    @abstractmethod
    def send(
        self,
        peer: dict[str, Any],
        request_id: str,
        layers: list[int],
        src_block_ids: list[int],
        dst_block_ids: list[int],
        last: bool,
        meta: dict[str, Any] | None = None,
    ) -> None:
        """Enqueue copying ``layers`` x ``src_block_ids`` into ``dst_block_ids`` at ``peer``.
        ``meta`` (msgpack-able, small: it travels in a frame header; only with ``last``)
        reaches the receiver with the completion: what the decode side needs to continue
        that only the transfer's end knows (a dropped prompt's kept blocks' scores).

        Non-blocking: a background thread moves the bytes while the caller computes the
        next layer. Layer-wise transfer calls this once per layer, full transfer once with
        all layers and ``last=True``; chunked prefill calls it several times per request.
        Sends of one request are applied in call order. Contiguous (src, dst) runs are
        coalesced into one write per layer per run.

        Raises ValueError at once for caller bugs (layout mismatch with the peer, ids out
        of range, length mismatch, a send after ``last=True``); network and receiver-side
        problems surface as FAILED in ``pop_finished`` instead.
        """

    @abstractmethod
    def status(self, request_id: str) -> TransferStatus:
        """Current status; KeyError for an unknown request."""

    @abstractmethod
    def pop_finished(self) -> list[Finished]:
        """Requests that became DONE or FAILED since the last call. DONE means the
        receiver confirmed and source blocks are no longer read; FAILED likewise means the
        sender stopped reading them."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Stop sending for the request and tell the receiver; it ends FAILED ("aborted")
        once no background write reads its source blocks any more."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters: ``num_writes`` (coalesced runs x layers), ``num_frames``,
        ``bytes_sent``, and ``requests`` mapping recent request ids to their own counts."""

    @abstractmethod
    def close(self) -> None:
        """Stop background threads and drop connections; unfinished requests fail."""


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
