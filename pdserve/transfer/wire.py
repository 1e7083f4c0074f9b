"""What crosses the socket between a sender and a receiver, and the receiver's accept loop.

Every connection starts with an HMAC-SHA256 challenge-response of fixed-size raw bytes, so
nothing from an unauthenticated peer is parsed::

    receiver -> sender   MAGIC (6) + server_nonce (32)
    sender -> receiver   client_nonce (32) + HMAC(secret, "client" + server_nonce + client_nonce)
    receiver -> sender   HMAC(secret, "server" + client_nonce + server_nonce)

Both sides prove the secret; it never crosses the wire (docs/transfer.md). Then frames::

    | u32 header_len (big-endian) | msgpack header (<= 64 KiB) | payload (header["nbytes"]) |

Only tcp ``data`` frames carry a payload (shm's have ``nbytes=0, written=True``). No pickle:
msgpack decodes to plain values only.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgpack

from pdserve import envs

log = logging.getLogger(__name__)

MAGIC = b"PDKV1\n"
NONCE_BYTES = 32
MAC_BYTES = 32
LEN = struct.Struct("!I")
MAX_HEADER_BYTES = 64 * 1024
# A peer that vanishes without a reset (power lost, link gone) would otherwise hold a
# connection for TCP's own ~15 min of retransmissions, and a prefill worker's send with it
# (its KV blocks stay pinned until the send ends): bytes unacknowledged this long, or an idle
# peer silent to keepalive probes, drop the connection.
LINK_TIMEOUT_S = 10.0

# Message types, sender -> receiver.
HELLO = "hello"  # {layout, process: [pid, pid namespace] (the writer, for shm fencing)}
DATA = "data"  # {request_id, layer, dst_start, num_blocks, nbytes, crc32?, written?}
LEASE = "lease"  # {request_id, writes: [[layer, dst_start, num_blocks], ...]}  (shm)
LEASE_END = "lease_end"  # {request_id}  (shm: the sender stopped writing)
DONE = "done"  # {request_id, num_frames, meta?}
ABORT = "abort"  # {request_id}
# Receiver -> sender.
HELLO_OK = "hello_ok"  # {} or {error}
LEASE_OK = "lease_ok"  # {request_id, block_ids} or {request_id, error}
ACK = "ack"  # {request_id}
FAILED = "failed"  # {request_id, error}


class AuthError(ConnectionError):
    """The peer failed the handshake (wrong secret, wrong protocol, or silence)."""


class ProtocolError(ConnectionError):
    """The byte stream is unusable (bad framing or header); the connection must close."""


class TransferError(Exception):
    """A request-level failure on the sender side (lease refused, peer lost, ...)."""


def check_secret(secret: bytes) -> bytes:
    if not isinstance(secret, bytes) or not secret:
        raise ValueError("transfer secret must be non-empty bytes (shared by the cluster)")
    return secret


def _mac(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, role + first + second, hashlib.sha256).digest()


def _recv_fixed(sock: socket.socket, n: int) -> bytes:
    data = bytearray(n)
    recv_exact_into(sock, memoryview(data))  # EOF: ConnectionError, an AuthError in _handshake
    return bytes(data)


@contextmanager
def _handshake(sock: socket.socket, timeout_s: float) -> Iterator[None]:
    """Bound the handshake by ``timeout_s``; any socket error becomes an AuthError."""
    old_timeout = sock.gettimeout()
    sock.settimeout(timeout_s)
    try:
        yield
    except AuthError:
        raise
    except OSError as e:  # TimeoutError included
        raise AuthError(f"authentication failed: {e}") from e
    finally:
        sock.settimeout(old_timeout)


def server_handshake(sock: socket.socket, secret: bytes, timeout_s: float = 5.0) -> None:
    """Authenticate a connecting client; raise AuthError (caller closes) on any failure."""
    with _handshake(sock, timeout_s):
        server_nonce = os.urandom(NONCE_BYTES)
        sock.sendall(MAGIC + server_nonce)
        reply = _recv_fixed(sock, NONCE_BYTES + MAC_BYTES)
        client_nonce, client_mac = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
        expected = _mac(secret, b"client", server_nonce, client_nonce)
        if not hmac.compare_digest(client_mac, expected):
            raise AuthError("client failed authentication (wrong secret?)")
        sock.sendall(_mac(secret, b"server", client_nonce, server_nonce))


def client_handshake(sock: socket.socket, secret: bytes, timeout_s: float = 5.0) -> None:
    """Authenticate to a receiver and check it knows the secret too."""
    with _handshake(sock, timeout_s):
        hello = _recv_fixed(sock, len(MAGIC) + NONCE_BYTES)
        if hello[: len(MAGIC)] != MAGIC:
            raise AuthError("peer is not a pdserve KV receiver (bad magic)")
        server_nonce = hello[len(MAGIC) :]
        client_nonce = os.urandom(NONCE_BYTES)
        sock.sendall(client_nonce + _mac(secret, b"client", server_nonce, client_nonce))
        server_mac = _recv_fixed(sock, MAC_BYTES)
        if not hmac.compare_digest(server_mac, _mac(secret, b"server", client_nonce, server_nonce)):
            raise AuthError("receiver failed authentication (wrong secret?)")


def send_frame(sock: socket.socket, header: dict[str, Any], payload: Any = None) -> None:
    """Send one frame; ``payload`` is any buffer (memoryview, numpy array) of nbytes."""
    body = msgpack.packb(header, use_bin_type=True)
    sock.sendall(LEN.pack(len(body)) + body)
    if payload is not None:
        sock.sendall(payload)


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from the socket or raise ConnectionError on EOF."""
    got = 0
    n = len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k


def recv_header(sock: socket.socket) -> dict[str, Any] | None:
    """Receive one frame header; None on a clean EOF between frames."""
    prefix = bytearray(LEN.size)
    k = sock.recv_into(prefix, LEN.size)
    if k == 0:
        return None
    if k < LEN.size:
        recv_exact_into(sock, memoryview(prefix)[k:])
    (length,) = LEN.unpack(prefix)
    if length == 0 or length > MAX_HEADER_BYTES:
        raise ProtocolError(f"frame header length {length} outside 1..{MAX_HEADER_BYTES}")
    body = bytearray(length)
    recv_exact_into(sock, memoryview(body))
    try:
        header = msgpack.unpackb(bytes(body), raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError(f"frame header is not valid msgpack: {e}") from e
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise ProtocolError("frame header must be a map with a string 'type'")
    return header


def int_field(header: dict[str, Any], name: str) -> int:
    value = header.get(name)
    if type(value) is not int or value < 0:
        raise ProtocolError(f"{header['type']} field {name!r} must be an int >= 0: {value!r}")
    return value


def str_field(header: dict[str, Any], name: str) -> str:
    value = header.get(name)
    if not isinstance(value, str):
        raise ProtocolError(f"{header['type']} field {name!r} must be a str: {value!r}")
    return value


@functools.cache
def host_identity() -> str:
    """Hostname + kernel boot id: equal on both ends only when they share a machine (and
    so can share /dev/shm). The boot id tells apart hosts that reuse a hostname. `PDSERVE_HOST_ID`
    overrides it (`envs.HOST_ID`)."""
    if envs.host_id():
        return envs.host_id()
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = "unknown"
    return f"{socket.gethostname()}/{boot_id}"


def connect(host: str, port: int, timeout_s: float) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout_s)
    sock.settimeout(None)
    tune(sock)
    return sock


def tune(sock: socket.socket) -> None:
    """No Nagle delay; a dead peer is noticed within LINK_TIMEOUT_S (Linux's TCP options)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(LINK_TIMEOUT_S * 1000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, int(LINK_TIMEOUT_S / 2))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, int(LINK_TIMEOUT_S / 2))


def process_identity() -> list[int]:
    """[pid, pid namespace inode]: a pid means this process only to a peer in the same
    pid namespace (containers sharing a host and /dev/shm may not share one)."""
    return [os.getpid(), os.stat("/proc/self/ns/pid").st_ino]


def open_process(identity: Any) -> int | None:
    """A pidfd for the peer process ``process_identity`` described, when it lives in our
    pid namespace; it becomes readable once that process has exited. A pidfd, not the
    pid, so a reused pid cannot pass for the writer."""
    ok = isinstance(identity, list) and len(identity) == 2
    if not ok or not all(type(x) is int and x > 0 for x in identity):
        return None
    try:
        if identity[1] != os.stat("/proc/self/ns/pid").st_ino:
            return None
        return os.pidfd_open(identity[0])
    except (OSError, AttributeError):  # gone already, or no pidfd (Linux < 5.3)
        return None


class Conn:
    """One sender's connection to the receiver, and what it holds, to clean up when it drops."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.leases: dict[Any, int] = {}  # Reservation -> shm leases held on this connection
        self.touched: set[str] = set()  # requests with frames on this connection
        self.told_failed: set[str] = set()  # requests this sender was told are FAILED
        self.hello_done = False
        self.pidfd: int | None = None  # the sender's process (same host), from its hello
        self._send_lock = threading.Lock()  # replies come from its thread and from release()

    def reply(self, header: dict[str, Any]) -> None:
        with self._send_lock:
            send_frame(self.sock, header)

    def held(self, request_id: str) -> Any:
        """The reservation of a lease held here for the request (released ones included)."""
        return next((r for r, n in self.leases.items() if n and r.request_id == request_id), None)

    def close_pidfd(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


class FrameServer:
    """The receiver's listener: accept, authenticate, then call ``on_frame(conn, header)``
    for each frame and ``on_drop(conn, reason)`` once when the connection ends. Handlers
    raise ProtocolError to drop the connection. One thread per connection (it carries one
    sender's frames in order). Bounded, so no peer can exhaust threads or descriptors: a
    connection over ``MAX_HANDSHAKES`` authenticating or ``MAX_CONNECTIONS`` authenticated
    is closed as soon as it is accepted (docs/transfer.md, "Authentication")."""

    MAX_HANDSHAKES = 16
    MAX_CONNECTIONS = 128
    ACCEPT_RETRY_S = 0.1

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
        self.counts = {"rejected_auth": 0, "connections": 0, "rejected_busy": 0}
        self._lock = threading.Lock()
        self._conns: set[Conn] = set()
        self._num_handshakes = 0
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
            except OSError as e:
                if self.closed or e.errno not in _RETRY_ACCEPT:
                    return
                log.error("KV receiver cannot accept (%s); retrying", e)
                time.sleep(self.ACCEPT_RETRY_S)
                continue
            with self._lock:
                busy = self._num_handshakes >= self.MAX_HANDSHAKES
                busy = busy or len(self._conns) >= self.MAX_CONNECTIONS
                if busy:
                    self.counts["rejected_busy"] += 1
                else:
                    self._num_handshakes += 1
            if busy:
                sock.close()
                continue
            try:
                name = f"kv-rx-conn-{self.port}"
                threading.Thread(target=self._serve, args=(sock,), name=name, daemon=True).start()
            except RuntimeError as e:  # no thread to be had
                log.error("KV receiver cannot start a connection thread: %s", e)
                with self._lock:
                    self._num_handshakes -= 1
                sock.close()

    def _serve(self, sock: socket.socket) -> None:
        try:
            server_handshake(sock, self._secret, self._auth_timeout_s)
        except AuthError as e:
            with self._lock:
                self._num_handshakes -= 1
                self.counts["rejected_auth"] += 1
            log.warning("KV receiver refused a connection: %s", e)
            sock.close()
            return
        conn = Conn(sock)
        with self._lock:
            self._num_handshakes -= 1
            if self.closed:
                sock.close()
                return
            self._conns.add(conn)
            self.counts["connections"] += 1
        tune(sock)
        reason = "sender connection closed"
        try:
            while (header := recv_header(sock)) is not None:
                self._on_frame(conn, header)
        except (OSError, ProtocolError) as e:
            reason = f"sender connection lost: {e}"
            if not self.closed:
                log.warning("KV receiver dropping a connection: %s", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            self._on_drop(conn, reason)
            sock.close()


# accept() errors that pass: out of descriptors or kernel memory, or a peer gone before
# accept returned. Anything else means the listener itself is gone.
_RETRY_ACCEPT = {
    errno.EMFILE,
    errno.ENFILE,
    errno.ENOBUFS,
    errno.ENOMEM,
    errno.ECONNABORTED,
    errno.EPROTO,
}
