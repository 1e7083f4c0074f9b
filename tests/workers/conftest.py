"""A real worker process on the tiny model, driven by the test as its router."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from pdserve import envs
from pdserve import messages as m
from pdserve.cluster.launcher import free_port
from pdserve.config import CacheConfig, DeviceConfig, EngineConfig
from pdserve.workers.spec import WorkerSpec

KV_BYTES = 256 * 16 * 512  # 256 blocks of 16 tokens


class WorkerProcess:
    def __init__(self, model_dir: Path, cpus: tuple[int, ...]) -> None:
        self.secret = secrets.token_bytes(32)
        self.signer, self.verifier = m.Signer(self.secret), m.Verifier(self.secret)
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        port = self.inbox.bind_to_random_port("tcp://127.0.0.1")
        ctrl = f"tcp://127.0.0.1:{free_port()}"
        engine = EngineConfig(
            model=str(model_dir),
            cache=CacheConfig(kv_cache_bytes=KV_BYTES),
            device=DeviceConfig(threads=len(cpus)),
        )
        spec = WorkerSpec(
            worker_id="w",
            role="collocated",
            engine=engine,
            ctrl_address=ctrl,
            router_address=f"tcp://127.0.0.1:{port}",
            cpus=cpus,
            adaptive=True,
        )
        self.popen = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdserve.workers.main",
                "--spec",
                spec.to_json(),
                "--log-level",
                "WARNING",
            ],
            env=envs.child_env(self.secret),
        )
        self.ctrl = self.ctx.socket(zmq.PUSH)
        self.ctrl.setsockopt(zmq.LINGER, 0)
        self.ctrl.connect(ctrl)
        self.seen: list[Any] = []  # every message received, in order
        self.ready = self.expect(m.Ready, timeout_s=120)

    def send(self, message: Any) -> None:
        self.ctrl.send(self.signer.encode(message))

    def _recv(self, timeout_s: float) -> Any | None:
        assert self.popen.poll() is None, f"worker exited with {self.popen.returncode}"
        if not self.inbox.poll(max(1, int(timeout_s * 1000))):
            return None
        message = self.verifier.decode(self.inbox.recv())
        self.seen.append(message)
        return message

    def expect(self, kind: type, timeout_s: float = 10.0, **fields: Any) -> Any:
        """The next message of `kind` (with `fields`) the worker sends; others are kept in
        `seen` only."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            message = self._recv(left)
            if isinstance(message, kind) and all(
                getattr(message, k) == v for k, v in fields.items()
            ):
                return message
        raise AssertionError(f"no {kind.__name__} {fields} within {timeout_s} s")

    def received(self, kind: type, timeout_s: float) -> list[Any]:
        """The messages of `kind` the worker sends within `timeout_s`."""
        deadline, found = time.monotonic() + timeout_s, []
        while (left := deadline - time.monotonic()) > 0:
            if isinstance(message := self._recv(left), kind):
                found.append(message)
        return found

    def affinities(self) -> dict[int, set[int]]:
        """Every thread of the worker process: its CPU affinity."""
        tasks = Path(f"/proc/{self.popen.pid}/task")
        return {int(t.name): os.sched_getaffinity(int(t.name)) for t in tasks.iterdir()}

    def cpu_seconds(self) -> float:
        """User + system CPU time of the whole process so far."""
        fields = Path(f"/proc/{self.popen.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        if self.popen.poll() is None:
            self.send(m.Shutdown())
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self.ctrl.close(0)
        self.inbox.close(0)
        self.ctx.term()


@pytest.fixture(scope="module")
def two_cores() -> tuple[int, ...]:
    cores = tuple(sorted(os.sched_getaffinity(0)))
    if len(cores) < 2:
        pytest.skip("needs two cores to move threads between")
    return cores[:2]


@pytest.fixture(scope="module")
def worker(tiny_model_dir, two_cores):
    w = WorkerProcess(tiny_model_dir, two_cores)
    yield w
    w.close()
