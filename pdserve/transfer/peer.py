"""The sender's side of one receiver: its address checked against the sender's layout and
backend, the authenticated connection to it, and the two data paths over it (``TcpWriter``,
``ShmWriter``).

Checks that catch caller bugs run in the caller's thread and raise ValueError at once;
everything that depends on the network or the receiver is reported later as FAILED. Only
the sender's per-receiver worker thread writes to the socket; the reader thread here
dispatches acks and failures to the sender and wakes threads waiting for a shm lease.
"""

from __future__ import annotations

import socket
import threading
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.transfer import wire
from pdserve.transfer.layout import KVLayout, block_bytes_view, check_ids
from pdserve.transfer.limits import BufferPool, TokenBucket
from pdserve.transfer.shm import sees_segment
from pdserve.transfer.wire import TransferError

LEASE_TIMEOUT_S = 10.0
Run = tuple[int, int, int]  # (src_start, dst_start, num_blocks), see layout.coalesce_runs


@dataclass
class PeerInfo:
    """What the sender needs from a receiver's ``address()``, checked once per send."""

    key: tuple[str, int]
    backends: list[str]
    use_shm: bool
    shm_name: str | None
    max_frame_bytes: int
    layout: KVLayout  # the receiver's (its pool size may differ from ours)
    mooncake: dict[str, Any] | None = None  # the receiver's engine, when the backend is mooncake


def parse_peer(peer: dict[str, Any], layout: KVLayout, backend: str) -> PeerInfo:
    """Check a receiver address against our layout and backend; pick shm or tcp (mooncake
    only when asked: ``auto`` never picks it)."""
    if not isinstance(peer, dict):
        raise ValueError(f"peer must be a receiver address dict, got {type(peer).__name__}")
    missing = [k for k in ("backends", "host", "port", "layout") if k not in peer]
    if missing:
        raise ValueError(f"peer address lacks {missing}; pass SocketKVReceiver.address()")
    peer_layout = KVLayout.from_dict(peer["layout"])
    if peer_layout.block_format() != layout.block_format():
        raise ValueError(f"KV layout mismatch: sender {layout.to_dict()}, peer {peer['layout']}")
    backends = list(peer["backends"])
    same_host = peer.get("host_id") == wire.host_identity()
    shm_ok = "shm" in backends and same_host and _shares_segment(peer)
    if backend == "shm" and not shm_ok:
        why = "does not offer shm" if "shm" not in backends else "is on another host"
        if "shm" in backends and same_host:
            why = "does not share this process's /dev/shm"
        raise ValueError(f"backend 'shm' requested but the receiver {why}")
    if backend in ("tcp", "mooncake") and backend not in backends:
        raise ValueError(f"backend {backend!r} requested but the receiver offers only {backends}")
    if backend == "mooncake" and not isinstance(peer.get("mooncake"), dict):
        raise ValueError("backend 'mooncake' requested but the receiver's address has no engine")
    if backend == "auto" and not shm_ok and "tcp" not in backends:
        raise ValueError(f"no common backend: receiver offers {backends} on another host")
    return PeerInfo(
        key=(str(peer["host"]), int(peer["port"])),
        backends=backends,
        use_shm=shm_ok and backend in ("auto", "shm"),
        shm_name=peer.get("shm_name"),
        max_frame_bytes=int(peer.get("max_frame_bytes") or layout.block_bytes),
        layout=peer_layout,
        mooncake=peer.get("mooncake") if backend == "mooncake" else None,
    )


def _shares_segment(peer: dict[str, Any]) -> bool:
    """The receiver's shm segment is the very file this process sees under its name."""
    name, identity = peer.get("shm_name"), peer.get("shm_file")
    if not isinstance(name, str) or not isinstance(identity, list) or len(identity) != 2:
        return False
    if not all(isinstance(x, int) for x in identity):
        return False
    return sees_segment(name, *identity)


def check_send(
    layout: KVLayout,
    backend: str,
    peer: dict[str, Any],
    request_id: str,
    layers: list[int],
    src_block_ids: list[int],
    dst_block_ids: list[int],
) -> PeerInfo:
    """The arguments of ``SocketKVSender.send`` checked; the peer's info, or ValueError."""
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
    if len(src_block_ids) != len(dst_block_ids):
        raise ValueError(
            f"src_block_ids ({len(src_block_ids)}) and dst_block_ids ({len(dst_block_ids)}) "
            "must have the same length"
        )
    check_ids("layers", list(layers), layout.num_layers)
    check_ids("src_block_ids", list(src_block_ids), layout.num_blocks)
    info = parse_peer(peer, layout, backend)
    check_ids("dst_block_ids", list(dst_block_ids), info.layout.num_blocks)
    return info


class PeerConnection:
    def __init__(
        self,
        host: str,
        port: int,
        secret: bytes,
        layout: KVLayout,
        on_message: Callable[[PeerConnection, dict[str, Any]], None],
        on_lost: Callable[[PeerConnection, str], None],
        timeout_s: float = 5.0,
    ) -> None:
        self.label = f"{host}:{port}"
        self.sock = wire.connect(host, port, timeout_s)
        try:
            wire.client_handshake(self.sock, secret, timeout_s)
            hello = {"type": wire.HELLO, "layout": layout.to_dict()}
            wire.send_frame(self.sock, {**hello, "process": wire.process_identity()})
            self.sock.settimeout(timeout_s)
            reply = wire.recv_header(self.sock)
            self.sock.settimeout(None)
            if reply is None or reply["type"] != wire.HELLO_OK or reply.get("error"):
                error = reply.get("error") if reply else "connection closed"
                raise ConnectionError(f"receiver {self.label} refused hello: {error}")
        except BaseException:
            self.sock.close()
            raise
        self._on_message, self._on_lost = on_message, on_lost
        self._lock = threading.Lock()
        self._lease_waiters: dict[str, tuple[threading.Event, dict[str, Any]]] = {}
        self.alive = True
        self._reader = threading.Thread(target=self._read_loop, daemon=True)
        self._reader.name = f"kv-tx-reader-{self.label}"
        self._reader.start()

    def send(self, header: dict[str, Any], payload: Any = None) -> None:
        if not self.alive:
            raise ConnectionError(f"connection to receiver {self.label} is closed")
        wire.send_frame(self.sock, header, payload)

    def request_lease(
        self, request_id: str, writes: list[list[int]], timeout_s: float
    ) -> list[int]:
        """Ask for permission to write ``writes``; the reserved block ids, or TransferError."""
        event, slot = threading.Event(), {}
        with self._lock:
            self._lease_waiters[request_id] = (event, slot)
        try:
            self.send({"type": wire.LEASE, "request_id": request_id, "writes": writes})
            if not event.wait(timeout_s):
                raise TransferError(f"no lease reply from {self.label} within {timeout_s} s")
        finally:
            with self._lock:
                self._lease_waiters.pop(request_id, None)
        if "error" in slot:
            raise TransferError(str(slot["error"]))
        block_ids = slot.get("block_ids")
        if not isinstance(block_ids, list):
            raise TransferError(f"malformed lease reply from {self.label}")
        return block_ids

    def _read_loop(self) -> None:
        reason = f"receiver {self.label} closed the connection"
        try:
            while (header := wire.recv_header(self.sock)) is not None:
                if header["type"] == wire.LEASE_OK:
                    with self._lock:
                        waiter = self._lease_waiters.get(str(header.get("request_id")))
                    if waiter is not None:
                        waiter[1].update(header)
                        waiter[0].set()
                else:
                    self._on_message(self, header)
        except (OSError, wire.ProtocolError) as e:
            reason = f"connection to receiver {self.label} lost: {e}"
        self.alive = False
        with self._lock:
            for event, slot in self._lease_waiters.values():
                slot["error"] = reason
                event.set()
        self._on_lost(self, reason)

    def close(self) -> None:
        self.alive = False
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        if threading.current_thread() is not self._reader:
            self._reader.join(timeout=2.0)


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
    # The receiver's engine as a mooncake.MooncakePeer (backend mooncake), else None; typed
    # loosely because mooncake.py builds its writer on this module.
    mooncake: Any = None


class BlockWriter(ABC):
    """One backend's data path from a sender to one receiver, over one connection.

    The sender calls ``write`` and ``finish`` from that receiver's worker thread only, so
    calls never overlap, in the order the engine sent. ``write`` copies ``runs`` of each of
    ``layers`` into the receiver's reserved blocks and counts through ``ctx.account`` (one
    write per run per layer, one frame per ``data`` frame, payload bytes); it returns early
    once ``ctx.stopped(request_id)``, and raises TransferError or OSError to fail the
    request. It must never write a block the receiver did not reserve for the request.
    """

    name: str  # the backend, as in pdserve.transfer.BACKENDS
    checksum: bool  # a crc32 in each data frame

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

    def data_header(
        self, request_id: str, layer: int, dst_start: int, num_blocks: int, nbytes: int, data: Any
    ) -> dict[str, Any]:
        """A ``data`` frame's header, with the crc32 of ``data`` (the blocks' bytes) when
        checksumming."""
        header = {
            "type": wire.DATA,
            "request_id": request_id,
            "layer": layer,
            "dst_start": dst_start,
            "num_blocks": num_blocks,
            "nbytes": nbytes,
        }
        return {**header, "crc32": zlib.crc32(data)} if self.checksum else header


class TcpWriter(BlockWriter):
    """Each run is one *write*, sent as frames of whole blocks (at most ``chunk_bytes`` and a
    staging buffer on either end), so every frame passes the receiver's size check alone."""

    name = "tcp"

    def __init__(self, ctx: WriteContext) -> None:
        super().__init__(ctx)
        frame_bytes = min(ctx.chunk_bytes, ctx.max_frame_bytes)
        if ctx.staging is not None:
            frame_bytes = min(frame_bytes, ctx.staging.buffer_bytes)
        self.blocks_per_frame = max(1, frame_bytes // ctx.layout.block_bytes)
        self.checksum = True if ctx.checksum is None else ctx.checksum

    def write(self, request_id: str, layers: list[int], runs: list[Run]) -> None:
        ctx = self.ctx
        for layer in layers:
            for src_start, dst_start, num_blocks in runs:
                for offset in range(0, num_blocks, self.blocks_per_frame):
                    if ctx.stopped(request_id):
                        return
                    n = min(self.blocks_per_frame, num_blocks - offset)
                    src = block_bytes_view(ctx.kv, layer, src_start + offset, n)
                    if ctx.staging is None:
                        self._send(request_id, layer, dst_start + offset, n, src)
                    else:
                        with ctx.staging.borrow() as buf:
                            staged = buf[: src.numel()]
                            staged.copy_(src)
                            self._send(request_id, layer, dst_start + offset, n, staged)
                ctx.account(request_id, 1, 0, 0)

    def _send(
        self, request_id: str, layer: int, dst_start: int, num_blocks: int, data: torch.Tensor
    ) -> None:
        payload = memoryview(data.numpy())
        header = self.data_header(request_id, layer, dst_start, num_blocks, len(payload), payload)
        if self.ctx.bucket is not None:
            self.ctx.bucket.consume(8 * len(payload))
        self.ctx.conn.send(header, payload)
        self.ctx.account(request_id, 0, 1, len(payload))


class LeasedWriter(BlockWriter):
    """A data path that writes the receiver's memory itself (shm, mooncake): each send asks
    for a lease on its (layer, run) writes (receiver.py), then writes only granted blocks,
    run by run, stopping once the request ended."""

    @abstractmethod
    def write_run(
        self, request_id: str, layer: int, src_start: int, dst_start: int, n: int
    ) -> None:
        """Copy one granted run of ``layer`` and send its ``data`` notice; returns early,
        without a notice, once ``ctx.stopped(request_id)``."""

    def lease(self, request_id: str, layers: list[int], runs: list[Run]) -> set[int]:
        """The block ids the receiver granted for these writes, or TransferError."""
        writes = [[layer, dst, n] for layer in layers for _, dst, n in runs]
        return set(self.ctx.conn.request_lease(request_id, writes, LEASE_TIMEOUT_S))

    def write_granted(
        self, request_id: str, layers: list[int], runs: list[Run], granted: set[int]
    ) -> None:
        for layer in layers:
            for src_start, dst_start, num_blocks in runs:
                if self.ctx.stopped(request_id):
                    return
                if not granted.issuperset(range(dst_start, dst_start + num_blocks)):
                    end = dst_start + num_blocks - 1
                    raise TransferError(
                        f"refusing {self.name} write to blocks {dst_start}..{end} of request "
                        f"{request_id!r}: not in the receiver's grant"
                    )
                self.write_run(request_id, layer, src_start, dst_start, num_blocks)

    def tell(self, request_id: str, lease_end: bool, abort: bool = False) -> None:
        """End the lease and/or abort the request at the receiver (which fails the
        reservation now, not at its deadline)."""
        try:
            if lease_end:
                self.ctx.conn.send({"type": wire.LEASE_END, "request_id": request_id})
            if abort:
                self.ctx.conn.send({"type": wire.ABORT, "request_id": request_id})
        except OSError:
            pass  # connection gone: the receiver ends the lease when it sees the drop


class ShmWriter(LeasedWriter):
    """Writes into ``ctx.remote_kv``, the receiver's pool mapped here, in chunks."""

    name = "shm"

    def __init__(self, ctx: WriteContext) -> None:
        if ctx.remote_kv is None:
            raise ValueError("ShmWriter needs the receiver's pool mapped (ctx.remote_kv)")
        super().__init__(ctx)
        self.remote_kv = ctx.remote_kv
        self.checksum = bool(ctx.checksum)

    def write(self, request_id: str, layers: list[int], runs: list[Run]) -> None:
        if not (layers and runs):
            return
        granted = self.lease(request_id, layers, runs)
        try:
            self.write_granted(request_id, layers, runs, granted)
        finally:
            self.tell(request_id, lease_end=True)

    def write_run(
        self, request_id: str, layer: int, src_start: int, dst_start: int, n: int
    ) -> None:
        ctx = self.ctx
        src = block_bytes_view(ctx.kv, layer, src_start, n)
        dst = block_bytes_view(self.remote_kv, layer, dst_start, n)
        # In chunks, checking for a stop before each: a receiver that released the request
        # (its "failed" stops us) waits for our lease_end, so stop soon, and never notify
        # for a run cut short.
        for offset in range(0, src.numel(), ctx.chunk_bytes):
            if ctx.stopped(request_id):
                return
            end = min(offset + ctx.chunk_bytes, src.numel())
            if ctx.bucket is not None:
                ctx.bucket.consume(8 * (end - offset))
            dst[offset:end].copy_(src[offset:end])
        header = self.data_header(request_id, layer, dst_start, n, 0, src.numpy())
        ctx.conn.send({**header, "written": True})
        ctx.account(request_id, 1, 1, src.numel())
