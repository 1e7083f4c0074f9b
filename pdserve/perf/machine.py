"""What this machine is and how fast it moves KV bytes: the CPU's name, the check that a
profile was measured here, loopback TCP and shared-memory bandwidth. Torch-free."""

from __future__ import annotations

import os
import platform
import socket
import threading
import time

import numpy as np

from pdserve.costmodel.profile import HardwareProfile
from pdserve.costmodel.step_cost import TransferModel


def cpu_name() -> str:
    with open("/proc/cpuinfo") as cpuinfo:
        return next(
            (line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")),
            platform.processor(),
        )


def check_same_machine(profile: HardwareProfile) -> None:
    """ValueError unless `profile` was measured on this CPU with this many cores."""
    if profile.kind != "measured" or profile.size_unit != "threads":
        raise ValueError(
            f"a {profile.kind} profile of {profile.device} is not this machine's: "
            "only a measured CPU profile rescales or updates"
        )
    here = (cpu_name(), len(os.sched_getaffinity(0)))
    there = (profile.machine.get("cpu"), profile.machine.get("cores"))
    if here != there:
        raise ValueError(
            f"the profile was measured on {there[0]!r} with {there[1]} cores, "
            f"this is {here[0]!r} with {here[1]}: profile this machine "
            "(pdserve profile)"
        )


def tcp_bandwidth(num_bytes: int = 64 * 2**20) -> TransferModel:
    """Loopback TCP: what the tcp backend's bytes pay in the kernel, one stream."""
    server = socket.create_server(("127.0.0.1", 0))
    payload = b"\0" * (4 * 2**20)

    def sink() -> None:
        conn, _ = server.accept()
        with conn:
            while conn.recv(4 * 2**20):
                pass

    thread = threading.Thread(target=sink)
    thread.start()
    with socket.create_connection(server.getsockname()) as client:
        t = time.perf_counter()
        client.sendall(b"\0")
        latency = time.perf_counter() - t
        start = time.perf_counter()
        for _ in range(num_bytes // len(payload)):
            client.sendall(payload)
    thread.join()
    server.close()
    return TransferModel(num_bytes / (time.perf_counter() - start), latency)


def shm_bandwidth(num_bytes: int = 64 * 2**20) -> TransferModel:
    """Shared memory: the shm backend copies into the segment and out of it (two copies)."""
    src, mid, dst = (np.ones(num_bytes, np.uint8) for _ in range(3))
    start = time.perf_counter()
    np.copyto(mid, src)
    np.copyto(dst, mid)
    return TransferModel(num_bytes / (time.perf_counter() - start), 0.0)
