"""Framing shared by every socket backend: length prefix + msgpack header + raw payload.

::

    | u32 header_len (big-endian) | msgpack header (<= 64 KiB) | payload (header["nbytes"]) |

Only ``data`` frames carry a payload; tcp sends block bytes there, shm sends the same header
with ``nbytes=0`` and ``written=True`` after writing the blocks itself. No pickle anywhere:
msgpack decodes to plain dicts, lists, strings and numbers only.
"""

from __future__ import annotations

import functools
import socket
import struct
from typing import Any

import msgpack

LEN = struct.Struct("!I")
MAX_HEADER_BYTES = 64 * 1024

# Message types, sender -> receiver.
HELLO = "hello"  # {layout}
DATA = "data"  # {request_id, layer, dst_start, num_blocks, nbytes, crc32?, written?}
LEASE = "lease"  # {request_id, writes: [[layer, dst_start, num_blocks], ...]}  (shm)
LEASE_END = "lease_end"  # {request_id}  (shm: the sender stopped writing)
DONE = "done"  # {request_id, num_frames}
ABORT = "abort"  # {request_id}
# Receiver -> sender.
HELLO_OK = "hello_ok"  # {} or {error}
LEASE_OK = "lease_ok"  # {request_id, block_ids} or {request_id, error}
ACK = "ack"  # {request_id}
FAILED = "failed"  # {request_id, error}


class ProtocolError(ConnectionError):
    """The byte stream is unusable (bad framing or header); the connection must close."""


def send_frame(sock: socket.socket, header: dict[str, Any], payload: Any = None) -> None:
    """Send one frame; ``payload`` is any buffer (memoryview, numpy array) of nbytes."""
    body = msgpack.packb(header, use_bin_type=True)
    if payload is None:
        sock.sendall(LEN.pack(len(body)) + body)
    else:
        sock.sendall(LEN.pack(len(body)) + body)
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
    so can share /dev/shm). The boot id tells apart hosts that reuse a hostname."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = "unknown"
    return f"{socket.gethostname()}/{boot_id}"


def connect(host: str, port: int, timeout_s: float) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout_s)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
