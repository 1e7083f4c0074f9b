"""L4: a Redis server shared by hosts, through redis-py (docs/tiers.md, "The tiers").

Every call has an overall deadline (`timeout_s`) for sending the command and reading the
whole reply, handshake included: a socket timeout alone bounds each socket operation, so a
server that trickles a reply would pass. The tier's sockets therefore set their timeout
before every send and receive to what is left of the calling thread's deadline (a thread per
call measured ~100 us of hand-off on a busy 2-core host). redis-py's retries are off.

A failed call marks the tier down for `backoff_s`, doubling per consecutive failure up to
`max_backoff_s`; while down every call is a miss/False without touching the network. Error
replies fail that call only. Capacity is Redis' job (``maxmemory``, an LRU policy), so this
tier never calls `on_evict`. A URL without a password takes PDSERVE_REDIS_PASSWORD's.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pdserve import envs
from pdserve.kvstore.base import EntryFormat, KVTier, Payload

log = logging.getLogger(__name__)

_call_deadline = threading.local()  # `at`: time.monotonic() by which this thread's call ends


class _DeadlineSocket(socket.socket):
    """A socket whose sends and receives end by the calling thread's deadline, if it has one.

    redis-py's own timeouts (`settimeout`: the socket timeout, or 0 for its "is there data?"
    polls) are kept when they are shorter than what is left of the deadline.
    """

    _timeout_s: float | None = None

    def settimeout(self, value: float | None) -> None:
        self._timeout_s = value
        super().settimeout(value)

    def _arm(self) -> None:
        deadline = getattr(_call_deadline, "at", None)
        timeout = self._timeout_s
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("redis call deadline passed")
            timeout = left if timeout is None else min(timeout, left)
        super().settimeout(timeout)

    def recv(self, *args: Any) -> bytes:
        self._arm()
        return super().recv(*args)

    def recv_into(self, *args: Any) -> int:
        self._arm()
        return super().recv_into(*args)

    def sendall(self, *args: Any) -> None:
        self._arm()
        return super().sendall(*args)


class _DeadlineConnection(redis.Connection):
    def _connect(self) -> socket.socket:
        sock = super()._connect()
        timeout = sock.gettimeout()
        wrapped = _DeadlineSocket(sock.family, sock.type, sock.proto, sock.detach())
        wrapped.settimeout(timeout)
        return wrapped


class _Unavailable(Exception):
    """The call did not reach a working server (down, backing off, or an error reply)."""


class RedisTier(KVTier):
    """Entries as Redis string values; see the module docstring for capacity and failures."""

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
        port = parts.port or 6379
        self.url = f"redis://{parts.hostname}:{port}/{db_text}"  # without the password
        pool = redis.ConnectionPool(
            connection_class=_DeadlineConnection,
            host=parts.hostname,
            port=port,
            db=int(db_text),
            username=unquote(parts.username) if parts.username else None,
            password=unquote(parts.password) if parts.password else envs.redis_password(),
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),  # one attempt: the deadline bounds the call
        )
        self._client = redis.Redis(connection_pool=pool)
        self._prefix = f"pdkv:{namespace or fmt.namespace}:".encode()
        self._ttl_ms = int(ttl_s * 1000) if ttl_s else None
        self.timeout_s = timeout_s
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.max_entry_bytes = max_entry_bytes
        self._lock = threading.Lock()  # guards the backoff state below
        self._next_backoff_s = backoff_s
        self._down_until = 0.0
        self._skipped = 0

    def _key(self, block_hash: int) -> bytes:
        return self._prefix + b"%016x" % (block_hash & 0xFFFF_FFFF_FFFF_FFFF)

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            if time.monotonic() < self._down_until:
                self._skipped += 1
                raise _Unavailable
        _call_deadline.at = time.monotonic() + self.timeout_s
        try:
            reply = fn(*args, **kwargs)
        except redis.ResponseError as e:
            log.warning("redis tier: %s: %s", fn.__name__, e)
            self._stats.add(errors=1)
            raise _Unavailable from e
        except (redis.RedisError, OSError) as e:
            with self._lock:
                if self._next_backoff_s == self.backoff_s:  # log the transition, not retries
                    log.warning(
                        "redis tier %s down (%r); retrying in %.1fs", self.url, e, self.backoff_s
                    )
                self._down_until = time.monotonic() + self._next_backoff_s
                self._next_backoff_s = min(2 * self._next_backoff_s, self.max_backoff_s)
            self._stats.add(errors=1)
            raise _Unavailable from e
        finally:
            _call_deadline.at = None
        with self._lock:
            self._next_backoff_s = self.backoff_s
        return reply

    def put(self, block_hash: int, payload: Payload) -> bool:
        header = self.fmt.encode_header(block_hash, payload)
        size = len(header) + memoryview(payload).nbytes
        if size > self.max_entry_bytes:
            self._stats.add(rejected_puts=1)
            return False
        try:
            self._call(self._client.set, self._key(block_hash), header + payload, px=self._ttl_ms)
        except _Unavailable:
            self._stats.add(rejected_puts=1)
            return False
        self._stats.add(puts=1, bytes_written=size)
        return True

    def get(self, block_hash: int) -> bytes | None:
        try:
            # At most one byte more than an entry: a crafted huge value costs no memory, and
            # a wrong size fails the decode. An empty reply is a missing key.
            key, end = self._key(block_hash), self.fmt.entry_bytes
            data = self._call(self._client.getrange, key, 0, end) or None
        except _Unavailable:
            data = None
        if data is None:
            self._stats.add(misses=1)
            return None
        return self._decode(block_hash, data)

    def _yes(self, fn: Callable[..., Any], *args: Any) -> bool:
        """`fn`'s reply as a bool; False when the server is unavailable."""
        try:
            return bool(self._call(fn, *args))
        except _Unavailable:
            return False

    def contains(self, block_hash: int) -> bool:
        return self._yes(self._client.exists, self._key(block_hash))

    def delete(self, block_hash: int) -> bool:
        return self._yes(self._client.delete, self._key(block_hash))

    def ping(self) -> bool:
        return self._yes(self._client.ping)

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
        self._client.close()
