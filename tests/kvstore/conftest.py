"""Fixtures for the KV store tests: a small entry format, payloads, and a private redis-server."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from pdserve.kvstore.base import EntryFormat

PAYLOAD_BYTES = 1024  # one block of the format below: 2 layers x K,V x 2 heads x 4 x 8 x 4 B
KEY = bytes(range(32))


@pytest.fixture
def fmt() -> EntryFormat:
    return EntryFormat(
        "test/tiny-llama",
        num_layers=2,
        num_kv_heads=2,
        block_size=4,
        head_dim=8,
        dtype="float32",
        key=KEY,
    )


def payload(seed: int) -> bytes:
    """A distinct payload per block hash, so a mixed-up entry is noticed."""
    return bytes((seed * 31 + i) % 251 for i in range(PAYLOAD_BYTES))


def entry_bytes(fmt: EntryFormat) -> int:
    """Stored size of one test entry: header + descriptor + payload."""
    return len(fmt.encode(0, payload(0)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RedisServer:
    port: int
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--maxmemory",
                "64mb",
                "--maxmemory-policy",
                "allkeys-lru",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (CI installs it in .ci/run)")
    server = RedisServer(free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def host_root(tmp_path):
    """A private root for HostTier directories, so tests never touch the real /dev/shm."""
    root = tmp_path / "shm"
    os.makedirs(root)
    return root
