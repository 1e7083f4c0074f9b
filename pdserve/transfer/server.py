"""The receiver's socket server: accept, authenticate, then hand frames to a handler.

Kept apart from the KV logic in ``receiver.py`` so the rules about what may touch memory
read on their own. One thread per connection: a connection carries one sender's frames in
order, and a handful of prefill workers per decode worker is the expected fan-in.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

from pdserve.transfer import protocol as P
from pdserve.transfer.auth import AuthError, server_handshake

log = logging.getLogger(__name__)


class Conn:
    """Per-connection state: the socket and what it holds, to clean up when it drops."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.leases: dict[str, int] = {}  # shm leases granted on this connection
        self.touched: set[str] = set()  # requests with frames on this connection
        self.told_failed: set[str] = set()  # requests this sender was told are FAILED
        self.hello_done = False

    def reply(self, header: dict[str, Any]) -> None:
        P.send_frame(self.sock, header)


class FrameServer:
    """Calls ``on_frame(conn, header)`` for each frame after auth; ``on_drop(conn, reason)``
    once when a connection ends. Handlers raise ProtocolError to drop the connection."""

    def __init__(
        self,
        host: str,
        port: int,
        secret: bytes,
        on_frame: Callable[[Conn, dict[str, Any]], None],
        on_drop: Callable[[Conn, str], None],
        auth_timeout_s: float = 5.0,
    ) -> None:
        self._secret, self._auth_timeout_s = secret, auth_timeout_s
        self._on_frame, self._on_drop = on_frame, on_drop
        self.counts = {"rejected_auth": 0, "connections": 0}
        self._lock = threading.Lock()
        self._conns: set[Conn] = set()
        self.closed = False
        self._listener = socket.create_server((host, port))
        self.port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, daemon=True)
        self._thread.name = f"kv-rx-accept-{self.port}"
        self._thread.start()

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            conns = list(self._conns)
        for sock in [self._listener] + [c.sock for c in conns]:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes threads blocked in accept/recv
            except OSError:
                pass
        self._listener.close()
        self._thread.join(timeout=2.0)

    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            server_handshake(sock, self._secret, self._auth_timeout_s)
        except AuthError as e:
            with self._lock:
                self.counts["rejected_auth"] += 1
            log.warning("KV receiver refused a connection: %s", e)
            sock.close()
            return
        conn = Conn(sock)
        with self._lock:
            if self.closed:
                sock.close()
                return
            self._conns.add(conn)
            self.counts["connections"] += 1
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reason = "sender connection closed"
        try:
            while (header := P.recv_header(sock)) is not None:
                self._on_frame(conn, header)
        except (OSError, P.ProtocolError) as e:
            reason = f"sender connection lost: {e}"
            if not self.closed:
                log.warning("KV receiver dropping a connection: %s", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            self._on_drop(conn, reason)
            sock.close()
