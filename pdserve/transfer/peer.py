"""A sender's authenticated connection to one receiver, with a thread reading its replies.

Only the sender's per-peer worker thread writes to the socket; the reader thread here
dispatches acks and failures to the sender and wakes threads waiting for a shm lease.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

from pdserve.transfer import protocol as P
from pdserve.transfer.auth import client_handshake
from pdserve.transfer.layout import KVLayout


class TransferError(Exception):
    """A request-level failure on the sender side (lease refused, peer lost, ...)."""


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
        self.sock = P.connect(host, port, timeout_s)
        try:
            client_handshake(self.sock, secret, timeout_s)
            P.send_frame(self.sock, {"type": P.HELLO, "layout": layout.to_dict()})
            self.sock.settimeout(timeout_s)
            reply = P.recv_header(self.sock)
            self.sock.settimeout(None)
            if reply is None or reply["type"] != P.HELLO_OK or reply.get("error"):
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
        P.send_frame(self.sock, header, payload)

    def request_lease(
        self, request_id: str, writes: list[list[int]], timeout_s: float
    ) -> list[int]:
        """Ask for permission to write ``writes``; the reserved block ids, or TransferError."""
        event, slot = threading.Event(), {}
        with self._lock:
            self._lease_waiters[request_id] = (event, slot)
        try:
            self.send({"type": P.LEASE, "request_id": request_id, "writes": writes})
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
            while (header := P.recv_header(self.sock)) is not None:
                if header["type"] == P.LEASE_OK:
                    with self._lock:
                        waiter = self._lease_waiters.get(str(header.get("request_id")))
                    if waiter is not None:
                        waiter[1].update(header)
                        waiter[0].set()
                else:
                    self._on_message(self, header)
        except (OSError, P.ProtocolError) as e:
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
