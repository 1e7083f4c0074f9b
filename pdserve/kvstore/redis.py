"""L4: a Redis server shared by hosts, through a minimal RESP client of our own.

Why not the `redis` package: we need five commands (GET, SET, DEL, EXISTS, PING, plus SELECT
and AUTH on connect), binary values, hard per-call timeouts and our own failure policy; 100
lines over a socket give exactly that with no new dependency, and every failure mode is one
code path we can test (any socket/protocol error closes the connection and backs off).

Failure policy: each socket operation has a short timeout (`timeout_s`, default 0.25 s). A
failed call closes the connection and marks the tier down for `backoff_s` (doubling per
consecutive failure up to `max_backoff_s`); while down every call returns a miss/False at
once without touching the network, so a dead Redis costs one timeout per backoff period, not
per call. The first call after the backoff reconnects. Server error replies (e.g. OOM under
maxmemory with `noeviction`) fail that call only.

Capacity is Redis' job: run it with ``maxmemory <bytes>`` and ``maxmemory-policy
allkeys-lru`` (Redis evicts approximately-LRU keys itself, so `capacity_bytes` is 0 and this
tier never calls `on_evict`; it is the last tier). `ttl_s` adds a per-key expiry on top, for
servers shared with data that must not be evicted (then use ``volatile-lru``). Keys are
``pdkv:<namespace>:<hash:016x>``, the namespace naming the model (see EntryFormat.namespace).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from urllib.parse import unquote, urlsplit

from pdserve.kvstore.base import EntryError, EntryFormat, KVTier, Payload

log = logging.getLogger(__name__)

Arg = bytes | list[Payload]  # a list is sent as one bulk string made of its parts


class RespError(Exception):
    """An error reply from the server; the connection stays usable."""


class RespClient:
    """One connection, opened lazily; not thread-safe (RedisTier serialises calls)."""

    def __init__(self, host: str, port: int, db: int, password: str | None, timeout_s: float):
        self.host, self.port, self.db, self.password = host, port, db, password
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._rfile = None

    def call(self, *args: Arg):
        """Send one command and read its reply; any socket or protocol error closes the
        connection (its state is unknown) and propagates as OSError."""
        if self._sock is None:
            self._connect()
        try:
            self._send(args)
            return self._read_reply()
        except (OSError, ValueError) as e:
            self.close()
            raise OSError(f"redis {self.host}:{self.port}: {e or type(e).__name__}") from e

    def _connect(self) -> None:
        sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock, self._rfile = sock, sock.makefile("rb")
        try:  # a connection that failed AUTH/SELECT must not serve the wrong database
            if self.password is not None:
                self.call(b"AUTH", self.password.encode())
            if self.db:
                self.call(b"SELECT", str(self.db).encode())
        except RespError as e:
            self.close()
            raise OSError(f"redis {self.host}:{self.port}: connect: {e}") from e

    def _send(self, args: tuple[Arg, ...]) -> None:
        buf = bytearray(b"*%d\r\n" % len(args))
        for arg in args:
            parts = arg if isinstance(arg, list) else [arg]
            buf += b"$%d\r\n" % sum(memoryview(p).nbytes for p in parts)
            for part in parts:
                if memoryview(part).nbytes < 65536:
                    buf += part
                else:  # large payloads go straight from the caller's buffer
                    self._sock.sendall(buf)
                    self._sock.sendall(part)
                    buf = bytearray()
            buf += b"\r\n"
        self._sock.sendall(buf)

    def _read_reply(self):
        line = self._rfile.readline()
        if not line.endswith(b"\r\n"):
            raise ConnectionError("connection closed mid-reply")
        kind, rest = line[:1], line[1:-2]
        if kind == b"+":
            return rest
        if kind == b"-":
            raise RespError(rest.decode(errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = self._rfile.read(n + 2)
            if len(data) != n + 2:
                raise ConnectionError("connection closed mid-value")
            return data[:-2]
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self._read_reply() for _ in range(n)]
        raise ValueError(f"bad RESP reply type {kind!r}")

    def close(self) -> None:
        if self._sock is not None:
            for closeable in (self._rfile, self._sock):
                try:
                    closeable.close()
                except OSError:
                    pass
        self._sock = self._rfile = None


class _Unavailable(Exception):
    """The call did not reach a working server (down, backing off, or an error reply)."""


class RedisTier(KVTier):
    """Entries as Redis string values; see the module docstring for capacity and failures.

    Calls share one connection under a lock, so a get may wait behind a writer-thread put
    (at most `timeout_s` per socket operation); one connection keeps the failure state simple.
    """

    def __init__(
        self,
        fmt: EntryFormat,
        url: str = "redis://127.0.0.1:6379/0",
        timeout_s: float = 0.25,
        ttl_s: float | None = None,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        namespace: str | None = None,
        max_entry_bytes: int = 512 << 20,
    ) -> None:
        super().__init__("redis", fmt, 0)
        parts = urlsplit(url)
        if parts.scheme != "redis" or not parts.hostname:
            raise ValueError(f"redis_url must look like redis://host:port/db, got {url!r}")
        db_text = parts.path.lstrip("/") or "0"
        if not db_text.isdigit():
            raise ValueError(f"redis_url database must be an integer, got {db_text!r} in {url!r}")
        password = unquote(parts.password) if parts.password else None
        port = parts.port or 6379
        self.url = f"redis://{parts.hostname}:{port}/{db_text}"  # without the password
        self._client = RespClient(parts.hostname, port, int(db_text), password, timeout_s)
        self._prefix = f"pdkv:{namespace or fmt.namespace}:".encode()
        self._ttl_ms = b"%d" % int(ttl_s * 1000) if ttl_s else None
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.max_entry_bytes = max_entry_bytes
        self._lock = threading.Lock()
        self._next_backoff_s = backoff_s
        self._down_until = 0.0
        self._skipped = 0

    def _key(self, block_hash: int) -> bytes:
        return self._prefix + b"%016x" % (block_hash & 0xFFFF_FFFF_FFFF_FFFF)

    def _call(self, *args: Arg):
        with self._lock:
            if time.monotonic() < self._down_until:
                self._skipped += 1
                raise _Unavailable
            try:
                reply = self._client.call(*args)
            except RespError as e:
                log.warning("redis tier: %s: %s", args[0].decode(), e)
                self._stats.add(errors=1)
                raise _Unavailable from e
            except OSError as e:
                if self._next_backoff_s == self.backoff_s:  # log the transition, not each retry
                    log.warning("redis tier down (%s); retrying in %.1fs", e, self.backoff_s)
                self._down_until = time.monotonic() + self._next_backoff_s
                self._next_backoff_s = min(2 * self._next_backoff_s, self.max_backoff_s)
                self._stats.add(errors=1)
                raise _Unavailable from e
            self._next_backoff_s = self.backoff_s
            return reply

    def put(self, block_hash: int, payload: Payload) -> bool:
        header = self.fmt.encode_header(block_hash, payload)
        size = len(header) + memoryview(payload).nbytes
        if size > self.max_entry_bytes:
            self._stats.add(rejected_puts=1)
            return False
        args: list[Arg] = [b"SET", self._key(block_hash), [header, payload]]
        if self._ttl_ms:
            args += [b"PX", self._ttl_ms]
        try:
            self._call(*args)
        except _Unavailable:
            self._stats.add(rejected_puts=1)
            return False
        self._stats.add(puts=1, bytes_written=size)
        return True

    def get(self, block_hash: int) -> bytes | None:
        try:
            data = self._call(b"GET", self._key(block_hash))
        except _Unavailable:
            data = None
        if data is None:
            self._stats.add(misses=1)
            return None
        try:
            payload = self.fmt.decode(block_hash, data)
        except EntryError as e:
            self._stats.add(misses=1, **{e.kind: 1})
            if e.kind == "corrupt":
                self.delete(block_hash)
            return None
        self._stats.add(hits=1, bytes_read=len(payload))
        return payload

    def contains(self, block_hash: int) -> bool:
        try:
            return bool(self._call(b"EXISTS", self._key(block_hash)))
        except _Unavailable:
            return False

    def delete(self, block_hash: int) -> bool:
        try:
            return bool(self._call(b"DEL", self._key(block_hash)))
        except _Unavailable:
            return False

    def ping(self) -> bool:
        try:
            return self._call(b"PING") == b"PONG"
        except _Unavailable:
            return False

    def stats(self) -> dict[str, int | float | str]:
        with self._lock:
            down, skipped = time.monotonic() < self._down_until, self._skipped
        return {
            **super().stats(),
            "url": self.url,
            "down": int(down),
            "skipped_while_down": skipped,
        }

    def close(self) -> None:
        with self._lock:
            self._client.close()
