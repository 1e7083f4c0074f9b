"""The prefill-side sender: per-receiver worker threads that push coalesced block runs.

``send`` only validates and enqueues, so the engine goes on computing the next layer while
a worker thread moves this one. One worker per receiver keeps a request's sends in call
order (one request has one receiver) and lets a slow receiver hold up only its own requests.
The data path per receiver is a ``BlockWriter`` (``peer.py``: tcp or shm) that
``make_writer`` builds for each connection from an explicit ``WriteContext``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from pdserve.transfer import wire
from pdserve.transfer.base import TERMINAL, Finished, TransferStatus
from pdserve.transfer.layout import KVLayout, check_kv_tensor, coalesce_runs
from pdserve.transfer.limits import (
    DEFAULT_BUFFER_BYTES,
    DEFAULT_POOL_BYTES,
    BufferPool,
    TokenBucket,
    parse_bandwidth,
)
from pdserve.transfer.mooncake import MooncakeWriter, mooncake_peer
from pdserve.transfer.peer import (
    BlockWriter,
    PeerConnection,
    PeerInfo,
    Run,
    ShmWriter,
    TcpWriter,
    WriteContext,
    check_send,
)
from pdserve.transfer.shm import open_shared_kv
from pdserve.transfer.wire import TransferError

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20  # pacing and tcp frame granularity
MAX_RECENT = 1024  # ended requests kept for status() and stats()
CONNECT_TIMEOUT_S = 5.0  # connect, handshake and hello


def open_writer(ctx: WriteContext) -> BlockWriter:
    """The default ``make_writer``: mooncake when the sender uses it, shm when the receiver's
    pool is mapped here, else tcp."""
    if ctx.mooncake is not None:
        return MooncakeWriter(ctx)
    return ShmWriter(ctx) if ctx.remote_kv is not None else TcpWriter(ctx)


@dataclass(eq=False)
class SendState:
    request_id: str
    peer_key: tuple[str, int]
    status: TransferStatus = TransferStatus.WAITING
    error: str | None = None
    pending: int = 0  # queued or running jobs; source blocks are read until this is 0
    last_sent: bool = False
    reported: bool = False
    conn: PeerConnection | None = None
    num_writes: int = 0
    num_frames: int = 0
    bytes_sent: int = 0

    def counts(self) -> dict[str, Any]:
        counts = {"status": self.status.value, "num_writes": self.num_writes}
        return {**counts, "num_frames": self.num_frames, "bytes_sent": self.bytes_sent}


@dataclass
class Job:
    state: SendState | None
    layers: list[int]
    runs: list[Run]
    last: bool
    abort_request_id: str | None = None
    meta: dict[str, Any] | None = None  # with the last job


class SocketKVSender:
    """Prefill side: copies blocks of its own ``kv`` into a receiver's reserved blocks.
    Construct through ``pdserve.transfer.make_sender``, which checks ``backend``.

    The caller guarantees source blocks are not modified until the request is reported
    DONE or FAILED by ``pop_finished``.
    """

    def __init__(
        self,
        kv: torch.Tensor,
        layout: KVLayout,
        secret: bytes,
        *,
        backend: str = "auto",
        bandwidth_bps: float | str | None = None,
        pool_bytes: int = DEFAULT_POOL_BYTES,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        checksum: bool | None = None,
        stage: bool | None = None,
        make_writer: Callable[[WriteContext], BlockWriter] = open_writer,
    ) -> None:
        """``checksum`` None means on for tcp, off for shm (a local memcpy has nothing to
        catch); ``stage`` None means stage through the buffer pool only when kv is not in
        host memory (device -> host copies in GPU backends). ``make_writer`` builds the
        data path of each new connection (tests wrap it to inject faults)."""
        check_kv_tensor(kv, layout)
        self.kv, self.layout, self._secret = kv, layout, wire.check_secret(secret)
        self.backend, self.make_writer = backend, make_writer
        rate = parse_bandwidth(bandwidth_bps)
        self.bucket = TokenBucket(rate) if rate else None
        self.checksum = checksum
        self.chunk_bytes = max(CHUNK_BYTES, layout.block_bytes)
        if stage is None:
            stage = kv.device.type != "cpu"
        self.pool = BufferPool(pool_bytes, buffer_bytes, layout.block_bytes) if stage else None
        self._lock = threading.Lock()
        self._requests: dict[str, SendState] = {}
        self._ended: OrderedDict[str, SendState] = OrderedDict()
        self._finished: list[Finished] = []
        self._peers: dict[tuple[str, int], _PeerWorker] = {}
        # shm_fallbacks: receivers offered shm whose segment could not be mapped, so tcp
        # carries their KV (the router shows them as pdserve_kv_transfer_fallbacks_total).
        self._totals = {"num_writes": 0, "num_frames": 0, "bytes_sent": 0, "shm_fallbacks": 0}
        # send_s: seconds the peer threads spent writing (blocked on the link when it is the
        # bottleneck): bytes_sent / send_s is the rate the link gave (the planner's link).
        self._totals["send_s"] = 0.0
        self.closing = False

    # -- public API ------------------------------------------------------------------------

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
        """Enqueue copying ``layers`` x ``src_block_ids`` into ``dst_block_ids`` at ``peer``,
        in call order per request, contiguous runs coalesced; ``meta`` (small, msgpack-able,
        only with ``last``) reaches the receiver with the completion (docs/transfer.md).

        Non-blocking. Raises ValueError at once for caller bugs (layout mismatch with the
        peer, ids out of range, length mismatch, a send after ``last=True``); network and
        receiver-side problems surface as FAILED in ``pop_finished`` instead.
        """
        if meta is not None and not (last and isinstance(meta, dict)):
            raise ValueError(f"meta must be a dict on the last send, got {meta!r:.80}")
        if meta and len(msgpack.packb(meta)) > wire.MAX_HEADER_BYTES // 2:
            raise ValueError(f"meta of {len(msgpack.packb(meta))} bytes: it must fit a header")
        info = check_send(
            self.layout, self.backend, peer, request_id, layers, src_block_ids, dst_block_ids
        )
        runs = coalesce_runs(src_block_ids, dst_block_ids)
        with self._lock:
            if self.closing:
                raise RuntimeError("send() on a closed SocketKVSender")
            if request_id in self._ended:
                return  # already failed/aborted: later layers are dropped, not an error
            state = self._requests.get(request_id)
            if state is None:
                state = self._requests[request_id] = SendState(request_id, info.key)
            if state.status in TERMINAL:
                return  # failed or aborted while the caller was computing: drop quietly
            if state.last_sent:
                raise ValueError(f"send() for {request_id!r} after its last=True send")
            if state.peer_key != info.key:
                raise ValueError(f"request {request_id!r} already sends to {state.peer_key}")
            state.pending += 1
            state.last_sent = last
            worker = self._peers.get(info.key)
            if worker is None:
                worker = self._peers[info.key] = _PeerWorker(self, info)
        worker.queue.put(Job(state, list(layers), runs, last, meta=meta))

    def status(self, request_id: str) -> TransferStatus:
        """Current status; KeyError for an unknown request."""
        with self._lock:
            state = self._requests.get(request_id) or self._ended.get(request_id)
        if state is None:
            raise KeyError(f"unknown request {request_id!r}")
        return state.status

    def pop_finished(self) -> list[Finished]:
        """Requests that became DONE or FAILED since the last call. DONE means the
        receiver confirmed and source blocks are no longer read; FAILED likewise means the
        sender stopped reading them."""
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    def abort(self, request_id: str) -> None:
        """Stop sending for the request and tell the receiver; it ends FAILED ("aborted")
        once no background write reads its source blocks any more."""
        with self._lock:
            state = self._requests.get(request_id)
            worker = self._peers.get(state.peer_key) if state is not None else None
        if state is None or not self.fail(state, "aborted"):
            return
        if worker is not None:
            worker.queue.put(Job(None, [], [], False, abort_request_id=request_id))

    def stats(self) -> dict[str, Any]:
        """Counters: ``num_writes`` (coalesced runs x layers), ``num_frames``,
        ``bytes_sent``, ``shm_fallbacks`` (connections that fell back to tcp), ``send_s``
        (seconds spent writing), and ``requests`` mapping recent request ids to their own
        counts."""
        with self._lock:
            states = list(self._ended.values()) + list(self._requests.values())
            requests = {s.request_id: s.counts() for s in states}
            peers = {
                f"{h}:{p}": w.writer.name if w.writer else None for (h, p), w in self._peers.items()
            }
            return {**self._totals, "requests": requests, "peers": peers}

    def close(self) -> None:
        """Stop background threads and drop connections; unfinished requests fail."""
        with self._lock:
            if self.closing:
                return
            self.closing = True
            workers = list(self._peers.values())
        for worker in workers:
            worker.stop()
        with self._lock:
            states = list(self._requests.values())
        for state in states:
            self.fail(state, "sender closed")

    # -- called by worker threads, writers and connection readers ---------------------------

    def stopped(self, request_id: str) -> bool:
        """True once the request is terminal or the sender closes; a request being written
        stays in ``_requests`` (its job is pending), so the lookup finds it."""
        with self._lock:
            state = self._requests.get(request_id)
        return self.closing or state is None or state.status in TERMINAL

    def account(self, request_id: str, writes: int, frames: int, nbytes: int) -> None:
        with self._lock:
            state = self._requests.get(request_id)
            if state is not None:
                state.num_writes += writes
                state.num_frames += frames
                state.bytes_sent += nbytes
            self._totals["num_writes"] += writes
            self._totals["num_frames"] += frames
            self._totals["bytes_sent"] += nbytes

    def fail(self, state: SendState, error: str) -> bool:
        with self._lock:
            if state.status in TERMINAL:
                return False
            state.status, state.error = TransferStatus.FAILED, error
            self._maybe_report(state)
            return True

    def job_started(self, state: SendState, conn: PeerConnection) -> None:
        with self._lock:
            if state.conn is None:
                state.conn = conn
            elif state.conn is not conn:
                raise TransferError("connection to the receiver was re-made mid-request")
            if state.status == TransferStatus.WAITING:
                state.status = TransferStatus.TRANSFERRING

    def job_done(self, state: SendState) -> None:
        with self._lock:
            state.pending -= 1
            self._maybe_report(state)

    def _maybe_report(self, state: SendState) -> None:
        """Report a terminal request once no worker reads its source blocks (lock held)."""
        if state.status not in TERMINAL or state.pending > 0 or state.reported:
            return
        state.reported = True
        state.conn = None
        self._finished.append((state.request_id, state.status, state.error))
        self._requests.pop(state.request_id, None)
        self._ended[state.request_id] = state
        while len(self._ended) > MAX_RECENT:
            self._ended.popitem(last=False)

    def on_message(self, conn: PeerConnection, header: dict[str, Any]) -> None:
        request_id = str(header.get("request_id"))
        with self._lock:
            state = self._requests.get(request_id)
        if state is None:
            return
        if header["type"] == wire.ACK:
            with self._lock:
                if state.status not in TERMINAL:
                    state.status = TransferStatus.DONE
                    self._maybe_report(state)
        elif header["type"] == wire.FAILED:
            self.fail(state, f"receiver rejected: {header.get('error')}")

    def on_lost(self, conn: PeerConnection, reason: str) -> None:
        with self._lock:
            states = [s for s in self._requests.values() if s.conn is conn]
        for state in states:
            self.fail(state, reason)


class _PeerWorker:
    """Queue, thread and (re)connection for one receiver address."""

    def __init__(self, sender: SocketKVSender, info: PeerInfo) -> None:
        self.sender, self.info = sender, info
        self.queue: queue.Queue[Job | None] = queue.Queue()
        self.conn: PeerConnection | None = None
        self.writer: BlockWriter | None = None
        self._remote_kv: torch.Tensor | None = None  # mapped once, kept across reconnects
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.name = f"kv-tx-{info.key[0]}:{info.key[1]}"
        self._thread.start()

    def _connected(self) -> tuple[PeerConnection, BlockWriter]:
        """The live connection and its writer, (re)connecting when there is none."""
        if self.conn is not None and self.conn.alive and self.writer is not None:
            return self.conn, self.writer
        s, info = self.sender, self.info
        self.conn = PeerConnection(
            *info.key, s._secret, s.layout, s.on_message, s.on_lost, CONNECT_TIMEOUT_S
        )
        if info.use_shm and self._remote_kv is None:
            try:
                self._remote_kv = open_shared_kv(info.shm_name, info.layout)
            except (OSError, ValueError) as e:
                if s.backend == "shm" or "tcp" not in info.backends:
                    raise TransferError(f"cannot map receiver shm {info.shm_name!r}: {e}") from e
                log.warning("shm unavailable (%s); falling back to tcp", e)
                info.use_shm = False
                with s._lock:
                    s._totals["shm_fallbacks"] += 1
        remote_kv = self._remote_kv if info.use_shm else None
        self.writer = s.make_writer(
            WriteContext(
                kv=s.kv,
                layout=s.layout,
                conn=self.conn,
                remote_kv=remote_kv,
                max_frame_bytes=info.max_frame_bytes,
                chunk_bytes=s.chunk_bytes,
                bucket=s.bucket,
                staging=s.pool,
                checksum=s.checksum,
                stopped=s.stopped,
                account=s.account,
                mooncake=mooncake_peer(self.conn, info) if info.mooncake is not None else None,
            )
        )
        return self.conn, self.writer

    def _run(self) -> None:
        while (job := self.queue.get()) is not None:
            if job.abort_request_id is not None:
                self._send_abort(job.abort_request_id)
                continue
            state = job.state
            assert state is not None
            try:
                if not self.sender.stopped(state.request_id):
                    conn, writer = self._connected()
                    self.sender.job_started(state, conn)
                    start = time.perf_counter()
                    writer.write(state.request_id, job.layers, job.runs)
                    if job.last and not self.sender.stopped(state.request_id):
                        writer.finish(state.request_id, state.num_frames, job.meta)
                    with self.sender._lock:
                        self.sender._totals["send_s"] += time.perf_counter() - start
            except (TransferError, OSError) as e:
                self.sender.fail(state, str(e) or type(e).__name__)
            except Exception as e:
                log.exception("KV sender worker failed")
                self.sender.fail(state, f"internal error: {e!r}")
            finally:
                self.sender.job_done(state)

    def _send_abort(self, request_id: str) -> None:
        """Tell the receiver, connecting if need be, so it frees the reservation promptly."""
        if self.sender.closing:
            return
        try:
            self._connected()[0].send({"type": wire.ABORT, "request_id": request_id})
        except (TransferError, OSError) as e:
            log.warning("could not tell the receiver about abort of %r: %s", request_id, e)

    def stop(self) -> None:
        self.queue.put(None)
        self._thread.join(timeout=5.0)
        if self.conn is not None:
            self.conn.close()
