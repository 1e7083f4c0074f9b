"""The mooncake backend: Mooncake's Transfer Engine (PyPI `mooncake-transfer-engine-non-cuda`,
its TCP transport; RDMA where a NIC exists) moves the block bytes, pdserve's authenticated
connection carries everything else; docs/transfer.md, "The mooncake backend", tells the
protocol (a lease per send as shm's, a ``data`` notice with a crc32 per run, ``lease_end``).

Mooncake authenticates nothing: any host that reaches an engine's ports may read or write
the memory registered with it. So the receiver registers only the ranges of a lease it
granted, until the request holds no lease (``MooncakeTarget``), and the sender registers
nothing. A chunk that makes no progress for ``STALL_TIMEOUT_S`` leaves its write in doubt (it
may still land): the request fails but keeps its lease, so the blocks stay fenced, until
Mooncake reports those chunks completed or failed.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from pdserve.transfer import wire
from pdserve.transfer.layout import KVLayout, block_bytes_view
from pdserve.transfer.peer import (
    LeasedWriter,
    PeerConnection,
    PeerInfo,
    Run,
    WriteContext,
)
from pdserve.transfer.wire import TransferError

log = logging.getLogger(__name__)

PACKAGE = "mooncake-transfer-engine-non-cuda"
PROTOCOL = "tcp"
# No metadata server: an engine serves its own segment descriptor on its RPC port, and a
# peer is named by "host:rpc_port".
METADATA = "P2PHANDSHAKE"
WINDOW_CHUNKS = 4  # chunks (ctx.chunk_bytes each) in flight per write
POLL_S = 0.0002
STALL_TIMEOUT_S = wire.LINK_TIMEOUT_S  # no chunk completing for this long: in doubt


class MooncakeUnavailable(ValueError):
    """The Mooncake library cannot be loaded (a ValueError: a worker prints it and exits)."""


def _engine_class() -> Any:
    try:
        from mooncake.engine import TransferEngine
    except (ImportError, OSError) as e:  # OSError: libibverbs.so.1 missing
        raise MooncakeUnavailable(
            f"transfer backend 'mooncake' needs {PACKAGE} and libibverbs1 "
            f"(pip install 'pdserve[mooncake]'; apt-get install libibverbs1): {e}"
        ) from e
    return TransferEngine


def unavailable() -> str:
    """Why the mooncake backend cannot run here, or "" when it can."""
    try:
        _engine_class()
    except MooncakeUnavailable as e:
        return str(e)
    return ""


def run_offset(layout: KVLayout, layer: int, block: int) -> int:
    """Byte offset of ``kv[layer, block]`` in a contiguous pool (layout.py's diagram)."""
    return (layer * layout.num_blocks + block) * layout.block_bytes


class Endpoint:
    """One Mooncake engine listening on ``host`` (its RPC port and TCP data port). A process
    keeps one per host (``shared``), as Mooncake intends (its allocator is process-wide)."""

    _shared: dict[str, Endpoint] = {}
    _shared_lock = threading.Lock()

    @classmethod
    def shared(cls, host: str) -> Endpoint:
        """The process's engine on ``host``, started once and never stopped: stopping one
        joins Mooncake's listener (a 1 s accept timeout) and its connections, 1 to 3 s at
        exit, which pushed workers past the launcher's 5 s grace into SIGKILL; the engine
        holds only sockets and threads, which the process's exit ends."""
        with cls._shared_lock:
            if host not in cls._shared:
                endpoint = cls._shared[host] = cls(host)
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(endpoint.engine))  # never freed
            return cls._shared[host]

    def __init__(self, host: str) -> None:
        if host in ("", "0.0.0.0", "::"):
            raise ValueError(f"transfer backend 'mooncake' needs a routable host, got {host!r}")
        engine = _engine_class()()
        rc = engine.initialize(host, METADATA, PROTOCOL, "")
        if rc != 0:
            raise OSError(f"the mooncake engine did not start on {host} (initialize: {rc})")
        self.engine = engine
        self.session = f"{host}:{engine.get_rpc_port()}"


class MooncakeTarget:
    """The receiver's engine. ``open`` registers a granted lease's ranges (under the
    reservation's lock, so never after ``release``); ``end`` unregisters a request's ranges
    once it holds no lease."""

    def __init__(self, kv: Any, layout: KVLayout, host: str) -> None:
        self.endpoint = Endpoint.shared(host)
        self.kv_ptr, self.layout = kv.data_ptr(), layout
        self._lock = threading.Lock()
        self._ranges: dict[Any, dict[int, int]] = {}  # reservation -> {address: nbytes}

    def address(self) -> dict[str, Any]:
        return {"session": self.endpoint.session, "kv_ptr": self.kv_ptr}

    def open(self, req: Any, writes: list[list[int]]) -> str | None:
        """Register each [layer, dst_start, num_blocks] of a lease; an error, or None."""
        with self._lock:
            ranges = self._ranges.setdefault(req, {})
            for layer, dst_start, num_blocks in writes:
                addr = self.kv_ptr + run_offset(self.layout, layer, dst_start)
                nbytes = num_blocks * self.layout.block_bytes
                if ranges.get(addr, 0) >= nbytes:
                    continue
                if addr in ranges:  # a longer run from the same block: re-register it
                    self.endpoint.engine.unregister_memory(addr)
                    del ranges[addr]
                if rc := self.endpoint.engine.register_memory(addr, nbytes):
                    return f"mooncake could not register layer {layer} blocks at {dst_start} ({rc})"
                ranges[addr] = nbytes
        return None

    def end(self, req: Any) -> None:
        with self._lock:
            ranges = self._ranges.pop(req, {})
            for addr in ranges:
                self.endpoint.engine.unregister_memory(addr)

    def close(self) -> None:
        with self._lock:
            reqs = list(self._ranges)
        for req in reqs:
            self.end(req)


@dataclass(frozen=True)
class MooncakePeer:
    """A sender's view of one receiver's engine: where its pool lies, through our engine."""

    endpoint: Endpoint  # the sender's own
    session: str  # the receiver's engine, "host:rpc_port"
    kv_ptr: int  # the receiver's pool, in its address space
    layout: KVLayout  # the receiver's (its pool size may differ from ours)

    @classmethod
    def parse(cls, endpoint: Endpoint, address: Any, layout: KVLayout) -> MooncakePeer:
        ok = isinstance(address, dict) and isinstance(address.get("session"), str)
        if not ok or type(address.get("kv_ptr")) is not int:
            raise ValueError(f"receiver's mooncake address must be session and kv_ptr: {address!r}")
        return cls(endpoint, address["session"], address["kv_ptr"], layout)


def mooncake_peer(conn: PeerConnection, info: PeerInfo) -> MooncakePeer:
    """The receiver ``info`` names, reached through this process's engine on the interface
    that reaches it; TransferError if its address is malformed or our engine cannot start."""
    try:
        endpoint = Endpoint.shared(conn.sock.getsockname()[0])
        return MooncakePeer.parse(endpoint, info.mooncake, info.layout)
    except ValueError as e:
        raise TransferError(str(e)) from e


class InDoubt(TransferError):
    """A submitted chunk neither completed nor failed in time: it may still land."""

    def __init__(self, message: str, in_flight: collections.deque[int]) -> None:
        super().__init__(message)
        self.in_flight = in_flight  # the chunks not yet completed or failed


class MooncakeWriter(LeasedWriter):
    """Writes through ``ctx.mooncake`` into the receiver's granted blocks, in chunks (at most
    ``WINDOW_CHUNKS`` in flight, so a revoked writer stops soon)."""

    name = "mooncake"

    def __init__(self, ctx: WriteContext) -> None:
        if not isinstance(ctx.mooncake, MooncakePeer):
            raise ValueError("MooncakeWriter needs the receiver's engine (ctx.mooncake)")
        super().__init__(ctx)
        self.peer: MooncakePeer = ctx.mooncake
        self.checksum = True if ctx.checksum is None else ctx.checksum  # bytes cross a network
        self._in_doubt: dict[str, collections.deque[int]] = {}  # request -> unresolved chunks

    def write(self, request_id: str, layers: list[int], runs: list[Run]) -> None:
        self._settle()
        if not (layers and runs):
            return
        granted = self.lease(request_id, layers, runs)
        try:
            self.write_granted(request_id, layers, runs, granted)
        except InDoubt as e:
            self._in_doubt[request_id] = e.in_flight  # no lease_end until they resolve
            self.tell(request_id, lease_end=False, abort=True)
            raise
        except (TransferError, OSError):
            self.tell(request_id, lease_end=True, abort=True)
            raise
        self.tell(request_id, lease_end=True)

    def finish(self, request_id: str, num_frames: int, meta: dict[str, Any] | None) -> None:
        self._settle()
        super().finish(request_id, num_frames, meta)

    def _settle(self) -> None:
        """End the leases of in-doubt writes whose chunks have all completed or failed
        since: no byte of theirs can land any more."""
        engine = self.peer.endpoint.engine
        for request_id, in_flight in list(self._in_doubt.items()):
            while in_flight and engine.transfer_check_status(in_flight[0]) in (1, -1):
                in_flight.popleft()
            if not in_flight:
                del self._in_doubt[request_id]
                self.tell(request_id, lease_end=True)

    def write_run(
        self, request_id: str, layer: int, src_start: int, dst_start: int, n: int
    ) -> None:
        ctx, peer = self.ctx, self.peer
        src = block_bytes_view(ctx.kv, layer, src_start, n)
        src_ptr, nbytes = src.data_ptr(), src.numel()
        dst_ptr = peer.kv_ptr + run_offset(peer.layout, layer, dst_start)
        in_flight: collections.deque[int] = collections.deque()
        failed = stopped = False
        for offset in range(0, nbytes, ctx.chunk_bytes):
            if ctx.stopped(request_id):
                stopped = True
                break
            length = min(ctx.chunk_bytes, nbytes - offset)
            if ctx.bucket is not None:
                ctx.bucket.consume(8 * length)
            batch = peer.endpoint.engine.transfer_submit_write(
                peer.session, src_ptr + offset, dst_ptr + offset, length
            )
            if batch == 0:  # nothing submitted: the peer's engine is unreachable
                failed = True
                break
            in_flight.append(batch)
            failed |= self._wait(in_flight, WINDOW_CHUNKS - 1)
        # the notice's crc32 while the last chunks are on the wire (1-2 ms a 3 MiB run)
        header = self.data_header(request_id, layer, dst_start, n, 0, src.numpy())
        failed |= self._wait(in_flight, 0)
        if failed:
            raise TransferError(
                f"mooncake write of {request_id!r} layer {layer} to {peer.session} failed "
                "(refused by the receiver's engine, or the link broke)"
            )
        if stopped:
            return  # never notify for a run cut short
        ctx.conn.send({**header, "written": True})
        ctx.account(request_id, 1, 1, nbytes)

    def _wait(self, in_flight: collections.deque[int], keep: int) -> bool:
        """Poll the oldest chunks until at most ``keep`` are in flight; True if one failed.
        Raises InDoubt when none completes for STALL_TIMEOUT_S."""
        engine, failed = self.peer.endpoint.engine, False
        deadline = time.monotonic() + STALL_TIMEOUT_S
        while len(in_flight) > keep:
            status = engine.transfer_check_status(in_flight[0])
            if status in (1, -1):  # completed, failed (the batch is freed either way)
                in_flight.popleft()
                failed |= status == -1
                deadline = time.monotonic() + STALL_TIMEOUT_S
            elif status == -2 or time.monotonic() > deadline:
                raise InDoubt(
                    f"mooncake write to {self.peer.session} stalled for {STALL_TIMEOUT_S} s",
                    in_flight,
                )
            else:
                time.sleep(POLL_S)
        return failed
