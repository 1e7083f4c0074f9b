"""Slow clients cost a socket for a bounded time, never a request slot.

An attacker's view, on 127.0.0.1 with a bounded number of raw sockets: request heads or bodies
dribbled a byte at a time, and a stream whose client never reads. With max_pending=2, honest
requests must still get 200 (not 429) meanwhile, and every slow connection must be closed by
the server within its timeout.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest
import requests

from pdserve.model.tokenizer import Tokenizer
from tests.router.harness import EOS, Cluster

TIMEOUT_S = 1.0
NUM_SLOW = 40
NUM_OUTPUT_TOKENS = 6000


@pytest.fixture(scope="module")
def cluster(tokenizer_dir: Path, tokenizer: Tokenizer):
    script = tokenizer.encode("ab " * (NUM_OUTPUT_TOKENS // 3)) + [EOS]
    limits = {"head_timeout_s": TIMEOUT_S, "body_timeout_s": TIMEOUT_S}
    behaviour = {"c0": {"step_s": 0.001, "max_model_len": 8192}}
    with Cluster(
        tokenizer_dir,
        script,
        {"c0": "collocated"},
        behaviour,
        max_pending=2,
        write_timeout_s=TIMEOUT_S,
        **limits,
    ) as c:
        yield c


def connect(cluster: Cluster, receive_buffer_bytes: int | None = None) -> socket.socket:
    sock = socket.socket()
    if receive_buffer_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer_bytes)
    sock.connect(("127.0.0.1", int(cluster.url.rsplit(":", 1)[1])))
    return sock


class Dribbler(threading.Thread):
    """Sends one byte per socket every 0.1 s and records when the server closed each one
    (and what it said first), for at most `limit_s`."""

    def __init__(self, sockets: list[socket.socket], limit_s: float = 6.0) -> None:
        super().__init__()
        self.sockets, self.limit_s = sockets, limit_s
        self.closed_after_s: dict[int, float] = {}
        self.replies = [b""] * len(sockets)

    def run(self) -> None:
        start = time.monotonic()
        while len(self.closed_after_s) < len(self.sockets):
            if time.monotonic() - start > self.limit_s:
                return
            for i, sock in enumerate(self.sockets):
                if i not in self.closed_after_s and not self._alive(i, sock):
                    self.closed_after_s[i] = time.monotonic() - start
            time.sleep(0.1)

    def _alive(self, i: int, sock: socket.socket) -> bool:
        try:
            while chunk := sock.recv(4096, socket.MSG_DONTWAIT):
                self.replies[i] += chunk
            return False  # b"": the server closed it
        except BlockingIOError:
            pass
        except OSError:
            return False
        try:
            sock.send(b"x")
        except OSError:
            return False
        return True


def honest_requests_succeed(cluster: Cluster) -> None:
    for _ in range(3):
        r = requests.post(
            f"{cluster.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=10
        )
        assert r.status_code == 200, r.text


def dribble_then_check(cluster: Cluster, first_bytes: bytes) -> Dribbler:
    sockets = [connect(cluster) for _ in range(NUM_SLOW)]
    try:
        for sock in sockets:
            sock.sendall(first_bytes)
        dribbler = Dribbler(sockets)
        dribbler.start()
        time.sleep(0.3)
        honest_requests_succeed(cluster)
        assert cluster.app_state.num_pending == 0  # the slow ones hold no slot
        dribbler.join()
    finally:
        for sock in sockets:
            sock.close()
    assert len(dribbler.closed_after_s) == NUM_SLOW  # every one was cut off
    assert max(dribbler.closed_after_s.values()) < TIMEOUT_S + 2.5
    assert min(dribbler.closed_after_s.values()) > TIMEOUT_S - 0.3
    return dribbler


def test_requests_may_run_longer_than_the_timeouts(cluster: Cluster) -> None:
    start = time.monotonic()
    body = {"prompt": "hi", "max_tokens": 2500}
    r = requests.post(f"{cluster.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2500
    assert time.monotonic() - start > 2 * TIMEOUT_S  # generating is not being slow


def test_dribbled_request_heads_are_closed_after_head_timeout(cluster: Cluster) -> None:
    dribble_then_check(cluster, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")


def test_dribbled_bodies_hold_no_slot_and_get_408(cluster: Cluster) -> None:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
    dribbler = dribble_then_check(cluster, head + b'{"prompt": "')
    assert all(b" 408 " in reply.split(b"\r\n", 1)[0] for reply in dribbler.replies)


def shrink_server_send_buffer(cluster: Cluster, sock: socket.socket) -> None:
    """Pin the server side of `sock` to a small kernel send buffer. Loopback lets it grow to
    4 MiB, which a test would have to fill first; the router's part is the same either way:
    a write that cannot drain."""
    client = sock.getsockname()

    async def shrink() -> bool:
        for handler in cluster.runner.server.connections:
            transport = handler.transport
            if transport is not None and transport.get_extra_info("peername") == client:
                server_sock = transport.get_extra_info("socket")
                server_sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
                return True
        return False

    cluster.wait_until(lambda: cluster.call(shrink()))


def test_client_that_stops_reading_a_stream_is_dropped(cluster: Cluster) -> None:
    worker = cluster.workers["c0"]
    num_tokens_before = worker.num_tokens_sent
    body = json.dumps({"prompt": "hi", "max_tokens": NUM_OUTPUT_TOKENS, "stream": True})
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    with connect(cluster, receive_buffer_bytes=4096) as sock:
        shrink_server_send_buffer(cluster, sock)
        sock.sendall(head.encode() + body.encode())  # ... and never reads
        cluster.wait_until(lambda: worker.aborted, timeout=TIMEOUT_S + 10)
        honest_requests_succeed(cluster)
        assert cluster.app_state.num_pending == 0
        # Generation stopped early: the server did not buffer the whole stream for it.
        num_tokens = worker.num_tokens_sent - num_tokens_before - 9  # the honest ones' 3 x 3
        assert num_tokens < NUM_OUTPUT_TOKENS // 2, num_tokens
        sock.settimeout(5)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except OSError:
            pass  # reset: the server aborted the connection
    assert received.startswith(b"HTTP/1.1 200") and b"[DONE]" not in received
