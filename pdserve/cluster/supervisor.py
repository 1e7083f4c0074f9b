"""Keeps a started cluster's processes running: a process that dies is started again, the
same way, after a backoff that doubles per restart within `window_s`; after `max_restarts`
there the supervisor gives up and `failure` says why (the launcher's `check_alive()` raises
it). `stop()` ends supervision before the launcher terminates anything. A restarted worker or
router re-announces itself (pdserve/messages.py).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.schema import check, knob

log = logging.getLogger(__name__)
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class RestartPolicy:
    backoff_s: float = knob(0.5, "wait before the first restart of a process", gt=0)
    max_backoff_s: float = knob(30.0, "longest wait between restarts", gt=0)
    max_restarts: int = knob(5, "restarts of one process within window_s, then give up", ge=0)
    window_s: float = knob(600.0, "the window restarts are counted in", gt=0)

    def __post_init__(self) -> None:
        check(self, "restart.")

    def delay_s(self, num_recent: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2**num_recent)


@dataclass
class Process:
    name: str
    launch: Callable[[], subprocess.Popen]  # starts it (again)
    popen: subprocess.Popen
    restarts: deque[float] = field(default_factory=deque)  # monotonic times, within the window
    due: float | None = None  # dead: when it is started again
    last_rss_bytes: int = 0  # its resident memory when last seen alive

    def sample_rss(self) -> None:
        """Note the process's RSS (/proc/<pid>/statm), so a death can say what it held."""
        try:
            with open(f"/proc/{self.popen.pid}/statm") as f:
                rss = int(f.read().split()[1]) * PAGE_BYTES
        except (OSError, IndexError, ValueError):
            return
        if rss:  # 0: it has just died (a zombie holds no memory), keep what it held
            self.last_rss_bytes = rss

    def exit_reason(self, code: int) -> str:
        """How it ended. pdserve sends SIGKILL only while stopping, so a SIGKILL before that
        is most often the kernel's OOM killer (dmesg, where readable, says so)."""
        if code == -signal.SIGKILL:
            return (
                f"was killed by SIGKILL (out of memory? its RSS was "
                f"{self.last_rss_bytes / 2**30:.2f} GiB when last seen)"
            )
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"


class Supervisor:
    """A thread that polls `processes` every `poll_s` and restarts the dead (module
    docstring). `lock` is the launcher's: no process starts while it is held by `stop`."""

    def __init__(
        self,
        processes: list[Process],
        policy: RestartPolicy,
        lock: threading.Lock,
        poll_s: float = 0.2,
    ) -> None:
        self.processes, self.policy, self.lock, self.poll_s = processes, policy, lock, poll_s
        self.failure: str | None = None
        self.pids: list[int] = [p.popen.pid for p in processes]  # every process ever started
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """No restart from now on (call with the lock free: the thread may be waiting on it)."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stopped.wait(self.poll_s):
            for proc in self.processes:
                self._check(proc, time.monotonic())

    def _check(self, proc: Process, now: float) -> None:
        code = proc.popen.poll()
        if code is None:
            proc.sample_rss()
        if code is None or self.failure is not None:
            return
        recent = proc.restarts
        while recent and now - recent[0] > self.policy.window_s:
            recent.popleft()
        if proc.due is None:
            if len(recent) >= self.policy.max_restarts:
                self.failure = (
                    f"{proc.name} {proc.exit_reason(code)} after {len(recent)} restarts within "
                    f"{self.policy.window_s:.0f} s: giving up (its log is above)"
                )
                log.error("supervisor: %s", self.failure)
                return
            delay_s = self.policy.delay_s(len(recent))
            log.warning(
                "%s %s: restarting it in %.1f s", proc.name, proc.exit_reason(code), delay_s
            )
            proc.due = now + delay_s
        if now < proc.due:
            return
        with self.lock:
            if self._stopped.is_set():
                return
            proc.popen = proc.launch()
        proc.due = None
        recent.append(now)
        self.pids.append(proc.popen.pid)
        log.warning("%s restarted (pid %d)", proc.name, proc.popen.pid)
