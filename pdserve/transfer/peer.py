"""The sender's view of one receiver: its address checked against the sender's layout and
backend, and the authenticated connection to it, with a thread reading its replies.

Checks that catch caller bugs run in the caller's thread and raise ValueError at once;
everything that depends on the network or the receiver is reported later as FAILED. Only
the sender's per-receiver worker thread writes to the socket; the reader thread here
dispatches acks and failures to the sender and wakes threads waiting for a shm lease.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.transfer import wire
from pdserve.transfer.layout import KVLayout
from pdserve.transfer.wire import TransferError


@dataclass
class PeerInfo:
    """What the sender needs from a receiver's ``address()``, checked once per send."""

    key: tuple[str, int]
    backends: list[str]
    use_shm: bool
    shm_name: str | None
    max_frame_bytes: int
    layout: KVLayout  # the receiver's (its pool size may differ from ours)


def parse_peer(peer: dict[str, Any], layout: KVLayout, backend: str) -> PeerInfo:
    """Check a receiver address against our layout and backend; pick shm or tcp."""
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
    shm_ok = "shm" in backends and same_host and bool(peer.get("shm_name"))
    if backend == "shm" and not shm_ok:
        why = "does not offer shm" if "shm" not in backends else "is on another host"
        raise ValueError(f"backend 'shm' requested but the receiver {why}")
    if backend == "tcp" and "tcp" not in backends:
        raise ValueError(f"backend 'tcp' requested but the receiver offers only {backends}")
    if backend == "auto" and not shm_ok and "tcp" not in backends:
        raise ValueError(f"no common backend: receiver offers {backends} on another host")
    return PeerInfo(
        key=(str(peer["host"]), int(peer["port"])),
        backends=backends,
        use_shm=shm_ok and backend != "tcp",
        shm_name=peer.get("shm_name"),
        max_frame_bytes=int(peer.get("max_frame_bytes") or layout.block_bytes),
        layout=peer_layout,
    )


def _check_ids(name: str, ids: list[int], limit: int) -> None:
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < limit:
            raise ValueError(f"{name} contains {i!r}, outside 0..{limit - 1}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{name} contains duplicates: {ids}")


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
    _check_ids("layers", list(layers), layout.num_layers)
    _check_ids("src_block_ids", list(src_block_ids), layout.num_blocks)
    info = parse_peer(peer, layout, backend)
    _check_ids("dst_block_ids", list(dst_block_ids), info.layout.num_blocks)
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
