"""The decode-side receiver: one authenticated TCP server for the tcp, shm and mooncake
backends.

tcp payloads are checked (reservation, size, checksum) in a staging buffer and only then
copied into KV memory, so a rejected frame never touches it. shm and mooncake senders get a
*lease* (the reserved block ids; for mooncake, their ranges registered with the engine for
the lease's life) before writing and send ``data`` notices with ``written=True`` after,
which are re-validated.

Fencing: a lease ends only on proof that its writer can no longer write: its ``lease_end``
or the exit of the sender's process (a pidfd from its hello); a dropped connection is no
proof. A reservation released while a lease is unproven stays *fenced*: ``release`` returns
False and the caller keeps its blocks out of reuse until ``pop_unfenced`` lists it
(docs/transfer.md, "Fencing").
"""

from __future__ import annotations

import logging
import select
import threading
import zlib
from typing import Any

import torch

from pdserve.transfer import wire
from pdserve.transfer.base import Finished, TransferStatus
from pdserve.transfer.layout import KVLayout, block_bytes_view, check_kv_tensor
from pdserve.transfer.limits import DEFAULT_BUFFER_BYTES, DEFAULT_POOL_BYTES, BufferPool
from pdserve.transfer.mooncake import MooncakeTarget
from pdserve.transfer.reservations import Reservation, ReservationTable
from pdserve.transfer.shm import segment_identity, unlink_shared_kv
from pdserve.transfer.wire import Conn, FrameServer

log = logging.getLogger(__name__)

AUTH_TIMEOUT_S = 5.0
# How long release() waits for a revoked writer: a cooperative one stops within one chunk
# (1 MiB, under a millisecond unpaced); past this the blocks are fenced instead.
RELEASE_WAIT_S = 1.0


class SocketKVReceiver:
    """Decode side: owns the destination KV tensor and admits writes only into reservations.

    Invariant: no byte reaches ``kv`` unless it belongs to a request with a live reservation
    (``expect`` called, ``release`` not yet called, not DONE/FAILED) and lands in that
    reservation's block ids. Anything else fails the request (or, for a request it does not
    know, is dropped) without touching memory.
    """

    def __init__(
        self,
        kv: torch.Tensor,
        layout: KVLayout,
        secret: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        backends: tuple[str, ...] = ("tcp",),
        shm_name: str | None = None,
        pool_bytes: int = DEFAULT_POOL_BYTES,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        mooncake: MooncakeTarget | None = None,
    ) -> None:
        """With shm, ``close`` unlinks the segment ``shm_name``; with mooncake, senders write
        through ``mooncake`` under leases, as shm senders do."""
        check_kv_tensor(kv, layout)
        if "shm" in backends and shm_name is None:
            raise ValueError("the shm backend needs the receiver's kv in shared memory")
        self.kv, self.layout, self._secret = kv, layout, wire.check_secret(secret)
        self.backends, self.shm_name, self.mooncake = tuple(backends), shm_name, mooncake
        self._one_sided = bool({"shm", "mooncake"} & set(backends))  # writers under leases
        self._shm_file = segment_identity(shm_name) if shm_name else None
        self.pool = BufferPool(pool_bytes, buffer_bytes, layout.block_bytes)
        self.table = ReservationTable(layout)
        self._counts = {"num_frames": 0, "bytes_received": 0, "rejected_frames": 0}
        self._lock = threading.Lock()
        self._fenced: dict[str, Reservation] = {}  # released with a lease not yet proven over
        self._orphans: list[Conn] = []  # dropped connections whose leases wait for a pidfd
        self._server = FrameServer(
            host, port, self._secret, self._on_frame, self._drop, AUTH_TIMEOUT_S
        )
        self._host = host

    # -- public API ------------------------------------------------------------------------

    def address(self) -> dict[str, Any]:
        """Msgpack-able connection info for senders: backends, host, port, shm name, layout,
        host identity. The router carries it from the decode worker to the prefill worker."""
        return {
            "backends": list(self.backends),
            "host": self._host,
            "port": self._server.port,
            "shm_name": self.shm_name,
            "shm_file": self._shm_file,  # a sender takes shm only if it sees this very file
            "layout": self.layout.to_dict(),
            "host_id": wire.host_identity(),
            "max_frame_bytes": self.pool.buffer_bytes,
            "mooncake": self.mooncake.address() if self.mooncake else None,
        }

    def expect(self, request_id: str, block_ids: list[int]) -> None:
        """Reserve ``block_ids`` for ``request_id``: only these may be written for it.

        Status becomes WAITING. Raises ValueError for an id already reserved or a block id
        out of range. Use a fresh request id for a retry: writes from an earlier attempt
        under the same id are indistinguishable from the new one's.
        """
        self.table.expect(request_id, block_ids)

    def status(self, request_id: str) -> TransferStatus:
        """Current status; KeyError for a request never expected or already released."""
        return self.table.status(request_id)

    def pop_finished(self) -> list[Finished]:
        """Requests that became DONE or FAILED since the last call, each once, with an
        error message for FAILED. DONE means every send up to the ``last=True`` one
        landed, in order, inside the reservation."""
        return self.table.pop_finished()

    def meta(self, request_id: str) -> dict[str, Any]:
        """What the sender's ``last=True`` send carried (empty when nothing), once DONE and
        until ``release``; KeyError otherwise."""
        return self.table.meta(request_id)

    def release(self, request_id: str) -> bool:
        """Forget the reservation; later writes are rejected. Releasing an unknown id is a
        no-op (True), so aborts may release unconditionally.

        True: no write for the request can touch memory any more; its blocks may be reused.
        False: a one-sided (shm) writer may still land in them, so they are *fenced*: the
        caller must keep them out of reuse until ``pop_unfenced`` lists the request."""
        req = self.table.release(request_id)
        if req is None:
            return True
        with req.cond:
            if req.active_leases == 0:
                return True
            holders = [conn for conn in req.holders if conn.leases.get(req)]
        for conn in holders:  # a cooperative writer stops at its next chunk
            self._tell_failed(conn, request_id, "reservation released by the receiver")
        with req.cond:
            if req.cond.wait_for(lambda: req.active_leases == 0, RELEASE_WAIT_S):
                return True
        with self._lock:
            self._fenced[request_id] = req
        log.error(
            "release(%r): a shm writer did not end its lease within %.1f s; its blocks stay "
            "fenced until it does or its process exits",
            request_id,
            RELEASE_WAIT_S,
        )
        return False

    def pop_unfenced(self) -> list[str]:
        """Released requests whose fenced blocks became safe to reuse since the last call,
        each once (the engine polls it with ``pop_finished``)."""
        self._reap()
        with self._lock:
            ended = [rid for rid, req in self._fenced.items() if req.active_leases == 0]
            for request_id in ended:
                del self._fenced[request_id]
        return ended

    def stats(self) -> dict[str, Any]:
        """Counters for tests and metrics (writes, frames, bytes, rejections)."""
        with self._lock:
            counts = {**self._counts, **self._server.counts}
            counts["num_fenced"], counts["num_orphans"] = len(self._fenced), len(self._orphans)
        return {**counts, "pool": self.pool.stats(), "num_reservations": len(self.table)}

    def close(self) -> None:
        """Stop accepting, drop connections, release shared memory this receiver owns."""
        if self._server.closed:
            return
        self._server.close()
        with self._lock:
            orphans, self._orphans = self._orphans, []
        for conn in orphans:
            conn.close_pidfd()
        if self.shm_name is not None:
            unlink_shared_kv(self.shm_name)
        if self.mooncake is not None:
            self.mooncake.close()

    # -- connections -----------------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def _on_frame(self, conn: Conn, header: dict[str, Any]) -> None:
        if conn.hello_done:
            self._dispatch(conn, header)
            return
        if header["type"] != wire.HELLO:
            raise wire.ProtocolError("expected a hello frame first")
        theirs, ours = header.get("layout"), self.layout.to_dict()
        # the pool size is each worker's own (block ids are checked per side)
        if not isinstance(theirs, dict) or {**theirs, "num_blocks": 0} != {**ours, "num_blocks": 0}:
            error = f"layout mismatch: receiver has {ours}, sender {theirs}"
            conn.reply({"type": wire.HELLO_OK, "error": error})
            raise wire.ProtocolError("sender layout differs from the receiver's")
        conn.hello_done = True
        if self._one_sided:
            conn.pidfd = wire.open_process(header.get("process"))
        conn.reply({"type": wire.HELLO_OK})

    def _drop(self, conn: Conn, reason: str) -> None:
        for request_id in conn.touched:
            req = self.table.get(request_id)
            if req is not None:
                self.table.fail(req, reason)
        if not any(conn.leases.values()):
            conn.close_pidfd()
        elif conn.pidfd is not None:
            with self._lock:
                self._orphans.append(conn)
        else:
            log.error("shm sender gone mid-write, process unknown: its leases never end")

    def _reap(self) -> None:
        """End the leases of dropped connections whose sender process has exited."""
        with self._lock:
            exited = [c for c in self._orphans if select.select([c.pidfd], [], [], 0)[0]]
            self._orphans = [c for c in self._orphans if c not in exited]
        for conn in exited:
            for req, num_leases in conn.leases.items():
                self._end_lease(req, num_leases)
            conn.leases.clear()
            conn.close_pidfd()

    def _dispatch(self, conn: Conn, header: dict[str, Any]) -> None:
        kind = header["type"]
        if kind == wire.DATA:
            self._on_data(conn, header)
        elif kind == wire.LEASE:
            self._on_lease(conn, header)
        elif kind == wire.LEASE_END:
            req = conn.held(wire.str_field(header, "request_id"))
            if req is not None:
                conn.leases[req] -= 1
                if not conn.leases[req]:
                    del conn.leases[req]  # a long-lived connection must not collect them
                self._end_lease(req, 1)
        elif kind == wire.DONE:
            request_id = wire.str_field(header, "request_id")
            req = self.table.get(request_id)
            error = (
                self.table.finish(req, wire.int_field(header, "num_frames"), header.get("meta"))
                if req
                else "unknown request"
            )
            if error is None:
                conn.reply({"type": wire.ACK, "request_id": request_id})
            else:
                self._reject(conn, request_id, req, error)
        elif kind == wire.ABORT:
            req = self.table.get(wire.str_field(header, "request_id"))
            if req is not None:
                self.table.fail(req, "aborted by sender")
        else:
            raise wire.ProtocolError(f"unknown frame type {kind!r}")

    def _reject(self, conn: Conn, request_id: str, req: Reservation | None, error: str) -> None:
        """Fail the request (if live) and tell this sender once; memory is not touched."""
        self._count("rejected_frames")
        if req is not None:
            self.table.fail(req, error)
        self._tell_failed(conn, request_id, error)

    def _tell_failed(self, conn: Conn, request_id: str, error: str) -> None:
        if request_id not in conn.told_failed:
            conn.told_failed.add(request_id)
            try:
                conn.reply({"type": wire.FAILED, "request_id": request_id, "error": error})
            except OSError:
                pass  # the connection's own thread sees the drop

    # -- data ------------------------------------------------------------------------------

    def _drain(self, conn: Conn, nbytes: int) -> None:
        """Read and discard a rejected payload so the next frame parses."""
        with self.pool.borrow() as buf:
            view = memoryview(buf.numpy())
            while nbytes > 0:
                k = min(nbytes, len(view))
                wire.recv_exact_into(conn.sock, view[:k])
                nbytes -= k

    def _on_data(self, conn: Conn, header: dict[str, Any]) -> None:
        request_id = wire.str_field(header, "request_id")
        layer, dst_start = wire.int_field(header, "layer"), wire.int_field(header, "dst_start")
        num_blocks, nbytes = wire.int_field(header, "num_blocks"), wire.int_field(header, "nbytes")
        crc, written = header.get("crc32"), header.get("written", False) is True
        req, error = self.table.check_write(request_id, layer, dst_start, num_blocks)
        if req is not None and error is None:
            conn.touched.add(request_id)
        if written:
            error = error or self._check_written(conn, request_id, nbytes)
        elif error is None and nbytes != num_blocks * self.layout.block_bytes:
            block_bytes = self.layout.block_bytes
            error = f"data frame for request {request_id!r} layer {layer}: nbytes {nbytes}"
            error += f" != {num_blocks} blocks x {block_bytes} bytes"
        elif error is None and nbytes > self.pool.buffer_bytes:
            error = f"frame of {nbytes} bytes exceeds max_frame_bytes {self.pool.buffer_bytes}"
        if error is not None:
            if nbytes:
                self._drain(conn, nbytes)
            self._reject(conn, request_id, req, error)
            return
        assert req is not None
        dst = block_bytes_view(self.kv, layer, dst_start, num_blocks)
        if written:
            error = self._check_in_place(req, dst, crc)
        else:
            error = self._copy_staged(conn, req, dst, nbytes, crc, layer)
        if error is not None:
            self._reject(conn, request_id, req, error)
            return
        self._count("num_frames")
        self._count("bytes_received", nbytes)

    def _check_in_place(self, req: Reservation, dst: torch.Tensor, crc: Any) -> str | None:
        """An shm write notice: the sender wrote `dst` itself; checked, then counted."""
        with req.cond:
            if crc is not None and zlib.crc32(dst.numpy()) != crc:
                return f"checksum mismatch in shm write of request {req.request_id!r}"
            if not req.live:
                return f"request {req.request_id!r} released; shm write notice rejected"
            self.table.mark_transferring(req, 0)
        return None

    def _copy_staged(
        self, conn: Conn, req: Reservation, dst: torch.Tensor, nbytes: int, crc: Any, layer: int
    ) -> str | None:
        """A data frame's payload: read into a staging buffer, checked, copied into `dst`."""
        with self.pool.borrow() as buf:
            staged = buf[:nbytes]
            wire.recv_exact_into(conn.sock, memoryview(staged.numpy()))
            if crc is not None and zlib.crc32(staged.numpy()) != crc:
                return f"checksum mismatch in request {req.request_id!r} layer {layer}"
            with req.cond:
                if not req.live:  # released or failed while the payload arrived
                    return f"request {req.request_id!r} released; late write dropped"
                dst.copy_(staged)
                self.table.mark_transferring(req, nbytes)
        return None

    # -- shm leases ------------------------------------------------------------------------

    def _check_written(self, conn: Conn, request_id: str, nbytes: int) -> str | None:
        if not self._one_sided:
            return "shm write notice, but this receiver does not offer shm"
        if nbytes != 0:
            return f"shm write notice with nbytes={nbytes} (must be 0)"
        if conn.held(request_id) is None:
            return f"shm write notice for request {request_id!r} without a lease"
        return None

    def _on_lease(self, conn: Conn, header: dict[str, Any]) -> None:
        request_id = wire.str_field(header, "request_id")
        writes = header.get("writes")
        req, error = self.table.get(request_id), None
        if req is None or not req.live:
            error = f"no live reservation for request {request_id!r}; lease refused"
        if not self._one_sided:
            error = "this receiver does not offer shm"
        if not isinstance(writes, list) or not writes:
            raise wire.ProtocolError("lease field 'writes' must be a non-empty list")
        for write in writes:
            if error is not None:
                break
            ok = isinstance(write, list) and len(write) == 3
            if not ok or not all(type(x) is int and x >= 0 for x in write):
                raise wire.ProtocolError(f"lease write must be [layer, dst_start, n]: {write!r}")
            _, error = self.table.check_write(request_id, *write)
        if error is None:
            assert req is not None
            with req.cond:  # atomic with release(): either it waits for us or we see it
                if req.live and self.mooncake is not None:
                    error = self.mooncake.open(req, writes)
                    if error is not None and req.active_leases == 0:
                        self.mooncake.end(req)
                if req.live and error is None:
                    req.active_leases += 1
                    req.holders.add(conn)
                    conn.leases[req] = conn.leases.get(req, 0) + 1
                    conn.touched.add(request_id)
                elif error is None:
                    error = f"request {request_id!r} released or finished; lease refused"
        if error is not None:
            self._reject(conn, request_id, req, error)
            conn.reply({"type": wire.LEASE_OK, "request_id": request_id, "error": error})
            return
        conn.reply({"type": wire.LEASE_OK, "request_id": request_id, "block_ids": req.block_ids})

    def _end_lease(self, req: Reservation, num_leases: int) -> None:
        with req.cond:
            req.active_leases -= num_leases
            if req.active_leases == 0 and self.mooncake is not None:
                self.mooncake.end(req)  # its ranges are no longer writable from the network
            req.cond.notify_all()
