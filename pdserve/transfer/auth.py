"""HMAC-SHA256 challenge-response run on every connection before anything else.

Messages are fixed-size raw bytes, so nothing from an unauthenticated peer is parsed::

    server -> client   MAGIC (6) + server_nonce (32)
    client -> server   client_nonce (32) + HMAC(secret, "client" + server_nonce + client_nonce)
    server -> client   HMAC(secret, "server" + client_nonce + server_nonce)

Both sides prove the secret (the sender must not push KV into an impostor either), the
secret never crosses the wire, and fresh nonces stop replays.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket

MAGIC = b"PDKV1\n"
NONCE_BYTES = 32
MAC_BYTES = 32


class AuthError(ConnectionError):
    """The peer failed the handshake (wrong secret, wrong protocol, or silence)."""


def check_secret(secret: bytes) -> bytes:
    if not isinstance(secret, bytes) or not secret:
        raise ValueError("transfer secret must be non-empty bytes (shared by the cluster)")
    return secret


def _mac(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, role + first + second, hashlib.sha256).digest()


def _recv_fixed(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise AuthError("peer closed the connection during authentication")
        data += chunk
    return bytes(data)


def server_handshake(sock: socket.socket, secret: bytes, timeout_s: float = 5.0) -> None:
    """Authenticate a connecting client; raise AuthError (caller closes) on any failure."""
    old_timeout = sock.gettimeout()
    sock.settimeout(timeout_s)
    try:
        server_nonce = os.urandom(NONCE_BYTES)
        sock.sendall(MAGIC + server_nonce)
        reply = _recv_fixed(sock, NONCE_BYTES + MAC_BYTES)
        client_nonce, client_mac = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
        expected = _mac(secret, b"client", server_nonce, client_nonce)
        if not hmac.compare_digest(client_mac, expected):
            raise AuthError("client failed authentication (wrong secret?)")
        sock.sendall(_mac(secret, b"server", client_nonce, server_nonce))
    except (TimeoutError, OSError) as e:
        if isinstance(e, AuthError):
            raise
        raise AuthError(f"authentication failed: {e}") from e
    finally:
        sock.settimeout(old_timeout)


def client_handshake(sock: socket.socket, secret: bytes, timeout_s: float = 5.0) -> None:
    """Authenticate to a receiver and check it knows the secret too."""
    old_timeout = sock.gettimeout()
    sock.settimeout(timeout_s)
    try:
        hello = _recv_fixed(sock, len(MAGIC) + NONCE_BYTES)
        if hello[: len(MAGIC)] != MAGIC:
            raise AuthError("peer is not a pdserve KV receiver (bad magic)")
        server_nonce = hello[len(MAGIC) :]
        client_nonce = os.urandom(NONCE_BYTES)
        sock.sendall(client_nonce + _mac(secret, b"client", server_nonce, client_nonce))
        server_mac = _recv_fixed(sock, MAC_BYTES)
        if not hmac.compare_digest(server_mac, _mac(secret, b"server", client_nonce, server_nonce)):
            raise AuthError("receiver failed authentication (wrong secret?)")
    except (TimeoutError, OSError) as e:
        if isinstance(e, AuthError):
            raise
        raise AuthError(f"authentication failed: {e}") from e
    finally:
        sock.settimeout(old_timeout)
