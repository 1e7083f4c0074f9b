"""The prefill-side sender: per-receiver worker threads that push coalesced block runs.

``send`` only validates and enqueues, so the engine goes on computing the next layer while
a worker thread moves this one. One worker per receiver keeps a request's sends in call
order (one request has one receiver) and lets a slow receiver hold up only its own requests.
The data path per receiver is tcp (``tcp.py``) or shm (``shm.py``), chosen once per peer.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from typing import Any

import torch

from pdserve.transfer import faults
from pdserve.transfer import protocol as P
from pdserve.transfer.auth import check_secret
from pdserve.transfer.bandwidth import TokenBucket, parse_bandwidth
from pdserve.transfer.base import Finished, KVSender, TransferStatus
from pdserve.transfer.buffer_pool import DEFAULT_BUFFER_BYTES, DEFAULT_POOL_BYTES, BufferPool
from pdserve.transfer.layout import KVLayout, check_kv_tensor, coalesce_runs
from pdserve.transfer.peer import PeerConnection, TransferError
from pdserve.transfer.send_state import Job, PeerInfo, SendState, validate_send

log = logging.getLogger(__name__)

TERMINAL = (TransferStatus.DONE, TransferStatus.FAILED)
CHUNK_BYTES = 1 << 20  # pacing and tcp frame granularity
MAX_RECENT = 1024


class SocketKVSender(KVSender):
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
        connect_timeout_s: float = 5.0,
        lease_timeout_s: float = 10.0,
    ) -> None:
        """``checksum`` None means on for tcp, off for shm (a local memcpy has nothing to
        catch); ``stage`` None means stage through the buffer pool only when kv is not in
        host memory (device -> host copies in GPU backends)."""
        check_kv_tensor(kv, layout)
        if backend not in ("auto", "tcp", "shm"):
            raise ValueError(f"unknown sender backend {backend!r}; choose auto, tcp or shm")
        self.kv, self.layout, self._secret = kv, layout, check_secret(secret)
        self.backend = backend
        rate = parse_bandwidth(bandwidth_bps)
        self.bucket = TokenBucket(rate, burst_bits=8 * CHUNK_BYTES) if rate else None
        self.checksum = checksum
        self.chunk_bytes = max(CHUNK_BYTES, layout.block_bytes)
        if stage is None:
            stage = kv.device.type != "cpu"
        self.pool: BufferPool | None = None
        if stage:
            buffer_bytes = max(buffer_bytes, layout.block_bytes)
            self.pool = BufferPool(max(pool_bytes, buffer_bytes), buffer_bytes)
        self.connect_timeout_s, self.lease_timeout_s = connect_timeout_s, lease_timeout_s
        self._lock = threading.Lock()
        self._requests: dict[str, SendState] = {}
        self._ended: OrderedDict[str, SendState] = OrderedDict()
        self._finished: list[Finished] = []
        self._peers: dict[tuple[str, int], _PeerWorker] = {}
        self._totals = {"num_writes": 0, "num_frames": 0, "bytes_sent": 0}
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
    ) -> None:
        info = validate_send(self, peer, request_id, layers, src_block_ids, dst_block_ids)
        runs = coalesce_runs(src_block_ids, dst_block_ids)
        with self._lock:
            if self.closing:
                raise RuntimeError("send() on a closed KVSender")
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
        worker.queue.put(Job(state, list(layers), runs, last))

    def status(self, request_id: str) -> TransferStatus:
        with self._lock:
            state = self._requests.get(request_id) or self._ended.get(request_id)
        if state is None:
            raise KeyError(f"unknown request {request_id!r}")
        return state.status

    def pop_finished(self) -> list[Finished]:
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    def abort(self, request_id: str) -> None:
        with self._lock:
            state = self._requests.get(request_id)
            worker = self._peers.get(state.peer_key) if state is not None else None
        if state is None or not self.fail(state, "aborted"):
            return
        if worker is not None:
            worker.queue.put(Job(None, [], [], False, abort_request_id=request_id))

    def stats(self) -> dict[str, Any]:
        with self._lock:
            states = list(self._ended.values()) + list(self._requests.values())
            requests = {s.request_id: s.counts() for s in states}
            peers = {
                f"{h}:{p}": w.path.name if w.path else None for (h, p), w in self._peers.items()
            }
            return {**self._totals, "requests": requests, "peers": peers}

    def close(self) -> None:
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

    # -- called by worker and reader threads -----------------------------------------------

    def should_stop(self, state: SendState) -> bool:
        return self.closing or state.status in TERMINAL

    def account(self, state: SendState, writes: int = 0, frames: int = 0, nbytes: int = 0) -> None:
        with self._lock:
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
        if header["type"] == P.ACK:
            with self._lock:
                if state.status not in TERMINAL:
                    state.status = TransferStatus.DONE
                    self._maybe_report(state)
        elif header["type"] == P.FAILED:
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
        self.path: Any = None
        self._remote_kv: torch.Tensor | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.name = f"kv-tx-{info.key[0]}:{info.key[1]}"
        self._thread.start()

    def _connect(self) -> None:
        s, info = self.sender, self.info
        self.conn = PeerConnection(
            *info.key, s._secret, s.layout, s.on_message, s.on_lost, s.connect_timeout_s
        )
        if info.use_shm and self._remote_kv is None:
            from pdserve.transfer.shm import open_shared_kv

            try:
                self._remote_kv = open_shared_kv(info.shm_name, info.layout)
            except (OSError, ValueError) as e:
                if s.backend == "shm" or "tcp" not in info.backends:
                    raise TransferError(f"cannot map receiver shm {info.shm_name!r}: {e}") from e
                log.warning("shm unavailable (%s); falling back to tcp", e)
                info.use_shm = False
        if info.use_shm:
            from pdserve.transfer.shm import ShmPath

            self.path = ShmPath(s, self.conn, self._remote_kv)
        else:
            from pdserve.transfer.tcp import TcpPath

            self.path = TcpPath(s, self.conn, info.max_frame_bytes)

    def _run(self) -> None:
        while (job := self.queue.get()) is not None:
            if job.abort_request_id is not None:
                self._send_abort(job.abort_request_id)
                continue
            state = job.state
            assert state is not None
            try:
                if not self.sender.should_stop(state):
                    if self.conn is None or not self.conn.alive:
                        self._connect()
                    assert self.conn is not None
                    self.sender.job_started(state, self.conn)
                    layers, injected = job.layers, None
                    if faults.FAULT_FILE is not None:  # test-only hook, see faults.py
                        state.fault = state.fault or faults.claim()
                        layers, injected = faults.layers_to_send(state.fault, layers)
                    self.path.write(state, layers, job.runs)
                    if injected:
                        raise TransferError(injected)
                    dropped = state.fault is not None and state.fault.kind == "drop_done"
                    if job.last and not dropped and not self.sender.should_stop(state):
                        frames = {"num_frames": state.num_frames}
                        self.conn.send({"type": P.DONE, "request_id": state.request_id, **frames})
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
            if self.conn is None or not self.conn.alive:
                self._connect()
            assert self.conn is not None
            self.conn.send({"type": P.ABORT, "request_id": request_id})
        except (TransferError, OSError) as e:
            log.warning("could not tell the receiver about abort of %r: %s", request_id, e)

    def stop(self) -> None:
        self.queue.put(None)
        self._thread.join(timeout=5.0)
        if self.conn is not None:
            self.conn.close()
