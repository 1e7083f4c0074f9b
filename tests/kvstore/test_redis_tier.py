"""RedisTier (L4) against a private redis-server: round trip, and a server that dies or hangs
turns every call into a fast miss/False, never an exception."""

from __future__ import annotations

import signal
import socket
import threading
import time

import pytest
import redis

from pdserve.kvstore.host import DiskTier, HostTier
from pdserve.kvstore.redis import RedisTier
from pdserve.kvstore.tiered import TieredStore
from tests.kvstore.conftest import entry_bytes, free_port, payload


def timed(fn, *args):
    start = time.monotonic()
    result = fn(*args)
    assert time.monotonic() - start < 1.0, f"{fn.__name__} took too long with Redis down"
    return result


def test_round_trip(fmt, redis_server):
    tier = RedisTier(fmt, redis_server.url, ttl_s=60)
    assert tier.ping() and tier.get(1) is None and not tier.contains(1)
    assert tier.put(1, payload(1)) and tier.put(2, memoryview(payload(2)))
    assert tier.get(1) == payload(1) and tier.get(2) == payload(2) and tier.contains(1)
    assert tier.delete(1) and tier.get(1) is None
    stats = tier.stats()
    assert (stats["hits"], stats["misses"], stats["errors"], stats["down"]) == (2, 2, 0, 0)
    tier.close()


def test_keys_carry_the_namespace_and_damage_is_a_miss(fmt, redis_server):
    tier = RedisTier(fmt, redis_server.url.replace("/0", "/3"))
    tier.put(7, payload(7))
    raw = redis.Redis(port=redis_server.port, db=3)
    key = f"pdkv:{fmt.namespace}:{7:016x}".encode()
    stored = raw.get(key)
    assert fmt.decode(7, stored) == payload(7)
    raw.set(key, stored[:-1])
    assert tier.get(7) is None and tier.stats()["corrupt"] == 1
    assert raw.exists(key) == 0  # a corrupt entry is deleted
    raw.close()


def test_server_killed_mid_run_degrades_to_fast_misses(fmt, redis_server):
    tier = RedisTier(fmt, redis_server.url, backoff_s=0.2)
    assert tier.put(1, payload(1)) and tier.get(1) == payload(1)
    redis_server.stop()
    for _ in range(20):
        assert timed(tier.get, 1) is None
        assert timed(tier.put, 2, payload(2)) is False
        assert timed(tier.contains, 1) is False
    stats = tier.stats()
    assert stats["down"] == 1 and stats["errors"] >= 1 and stats["skipped_while_down"] > 0
    redis_server.start()  # same port: after the backoff the tier reconnects by itself
    deadline = time.monotonic() + 5
    while not tier.put(3, payload(3)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tier.get(3) == payload(3)


def test_server_that_never_answers_times_out_then_backs_off(fmt):
    with socket.socket() as listener:  # accepts connections (kernel backlog), never replies
        listener.bind(("127.0.0.1", free_port()))
        listener.listen(8)
        port = listener.getsockname()[1]
        tier = RedisTier(fmt, f"redis://127.0.0.1:{port}/0", timeout_s=0.2, backoff_s=30)
        assert timed(tier.get, 1) is None  # pays one timeout
        start = time.monotonic()
        assert tier.get(1) is None and not tier.put(1, payload(1))
        assert time.monotonic() - start < 0.05  # backing off: no network at all
        assert tier.stats()["errors"] == 1


def test_paused_server_costs_one_deadline_per_backoff(fmt, redis_server):
    tier = RedisTier(fmt, redis_server.url, timeout_s=0.2, backoff_s=0.3)
    assert tier.put(1, payload(1))  # a pooled connection exists: the pause hits a live one
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        assert tier.get(1) is None
        assert 0.15 < time.monotonic() - start < 0.5
        start = time.monotonic()
        assert tier.get(1) is None and not tier.put(2, payload(2)) and not tier.contains(1)
        assert time.monotonic() - start < 0.05  # backing off
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 5
    while tier.get(1) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tier.get(1) == payload(1)
    tier.close()


def test_a_reply_trickling_within_socket_timeouts_still_meets_the_deadline(fmt):
    """Each byte comes well within the socket timeout; only an overall deadline stops it."""
    stop = threading.Event()

    def serve(listener: socket.socket) -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(4096)  # the GET
            for byte in b"$1024\r\n" + bytes(1024):
                if stop.wait(0.05):
                    return
                conn.sendall(bytes([byte]))

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", free_port()))
        listener.listen(8)
        server = threading.Thread(target=serve, args=(listener,), daemon=True)
        server.start()
        tier = RedisTier(fmt, f"redis://127.0.0.1:{listener.getsockname()[1]}/0", timeout_s=0.3)
        start = time.monotonic()
        assert tier.get(1) is None
        assert time.monotonic() - start < 0.45
        assert tier.stats()["down"] == 1
        stop.set()
        server.join(5)
        tier.close()


def test_bad_url_is_a_clear_error(fmt):
    with pytest.raises(ValueError, match="redis://host:port/db"):
        RedisTier(fmt, "http://localhost:6379")
    with pytest.raises(ValueError, match="database must be an integer"):
        RedisTier(fmt, "redis://localhost:6379/x")


def where_is(store: TieredStore, block_hashes) -> list[str]:
    return [next((t.name for t in store.tiers[:2] if t.contains(h)), "-") for h in block_hashes]


def test_tiered_store_keeps_serving_from_host_and_disk(fmt, redis_server, host_root, tmp_path):
    host = HostTier(fmt, 2 * entry_bytes(fmt), root=host_root)
    disk = DiskTier(fmt, tmp_path, 2 * entry_bytes(fmt))
    store = TieredStore([host, disk, RedisTier(fmt, redis_server.url)], async_puts=False)
    for h in range(1, 7):
        assert store.put(h, payload(h))
    assert store.tiers[2].contains(1)  # 1 and 2 walked down to Redis
    redis_server.stop()
    assert timed(store.get, 1) is None  # only Redis had it
    for h in (6, 5, 4):  # host and disk still serve
        assert timed(store.get, h) == payload(h)
    # Promoting 4 pushed 6 (least recent) down to disk and 3 from disk into the dead Redis: 3
    # is lost, as a cache may lose anything; the put that lost it was a fast False.
    assert where_is(store, [3, 4, 5, 6]) == ["-", "host", "host", "disk"]
    assert timed(store.put, 7, payload(7))
    assert store.stats()["tiers"][2]["rejected_puts"] >= 1
    assert all(tier["store_errors"] == 0 for tier in store.stats()["tiers"])
    store.close()
