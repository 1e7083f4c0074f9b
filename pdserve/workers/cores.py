"""A worker's cores: the CPU affinity of every thread of its process and torch's intra-op
thread count, changed between engine steps (`SetCores`, the adaptive planner's core groups).

Linux keeps affinity per thread: `os.sched_setaffinity(0, ...)` moves only the calling one,
while the OpenMP pool (torch's, which the native kernels share, pdserve/model/native.py),
ZMQ's I/O threads, the heartbeat and the transfer threads would stay where they were. So
every thread in /proc/self/task is moved. A thread started later inherits its creator's
affinity; the OpenMP threads a larger count needs are started here, before the move, so
none is left behind and the first step after a switch does not pay for their creation.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch


def pin_threads(cpus: Iterable[int]) -> None:
    """Every thread of this process on `cpus`, including threads started while it runs."""
    cpus = set(cpus)
    moved: set[int] = set()
    while todo := {int(t) for t in os.listdir("/proc/self/task")} - moved:
        for tid in todo:
            try:
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:  # the thread ended since the listing
                pass
        moved |= todo


class Cores:
    """What this worker runs on: `cpus` (its threads' affinity) and `threads` (torch's
    intra-op threads; 0 = parked: no engine step). Invariant: `cpus` lies within `pool`,
    the cores it was started with, and `threads <= len(cpus)`."""

    def __init__(self, pool: Iterable[int]) -> None:
        self.pool = frozenset(pool)
        self.cpus = sorted(os.sched_getaffinity(0))
        self.threads = torch.get_num_threads()

    @property
    def parked(self) -> bool:
        return self.threads == 0

    def refusal(self, cpus: list[int], threads: int) -> str | None:
        """Why SetCores(cpus, threads) cannot be applied, or None. An empty `cpus` with 0
        threads parks the worker where it runs."""
        outside = sorted(set(cpus) - self.pool)
        if outside:
            return f"cpus {outside} are outside this worker's pool {sorted(self.pool)}"
        if threads < 0 or threads > len(cpus):
            return f"threads must be between 0 and len(cpus) = {len(cpus)}, got {threads}"
        return None

    def apply(self, cpus: list[int], threads: int) -> None:
        """Runs on `cpus` with `threads` (checked by `refusal` first). Parked, the process keeps
        its threads (the control loop, transfers) on `cpus`, or where they are if empty."""
        if threads:
            torch.set_num_threads(threads)
            # A parallel op on every thread starts the OpenMP threads a larger count needs
            # (at::parallel_for splits by 32768 elements), so the move below reaches them.
            torch.ones(threads * 2**16).add_(1)
        if cpus:
            pin_threads(cpus)
        self.cpus = sorted(os.sched_getaffinity(0))
        self.threads = threads
