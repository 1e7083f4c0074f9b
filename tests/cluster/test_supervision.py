"""Supervision after start: dead processes come back with backoff, a process that keeps dying
is given up on loudly, stop means stop; a killed router and worker of a real cluster come
back, the workers re-announce to the new router and serve, and nothing is left after stop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from pdserve.cluster.config import Pipeline
from pdserve.cluster.launcher import Cluster, ClusterError, free_port
from pdserve.cluster.supervisor import Process, RestartPolicy, Supervisor
from tests.cluster.conftest import post, role
from tests.cluster.test_cluster import kv_blocks, wait_blocks_free


def launcher(code: str, starts: list[float]):
    def launch() -> subprocess.Popen:
        starts.append(time.monotonic())
        return subprocess.Popen([sys.executable, "-c", code])

    return launch


def test_a_dead_process_restarts_with_backoff_then_gives_up():
    starts: list[float] = []
    launch = launcher("import sys; sys.exit(3)", starts)
    policy = RestartPolicy(backoff_s=0.2, max_backoff_s=0.5, max_restarts=3, window_s=60)
    sup = Supervisor([Process("crasher", launch, launch())], policy, threading.Lock(), 0.02)
    sup.start()
    try:
        deadline = time.monotonic() + 30
        while sup.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sup.failure and "crasher exited with code 3 after 3 restarts" in sup.failure
        assert "giving up" in sup.failure
        gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
        assert len(starts) == 4  # the first start and three restarts, no more
        # Waits of 0.2, 0.4 and 0.5 s (capped), plus the time each process took to exit.
        for gap, wait in zip(gaps, (0.2, 0.4, 0.5), strict=True):
            assert wait <= gap < wait + 5
    finally:
        sup.stop()


def test_restarts_are_counted_in_a_window():
    """A process that dies now and then (less than the budget per window) is restarted for
    ever; the backoff restarts from its shortest once earlier restarts leave the window."""
    policy = RestartPolicy(backoff_s=0.1, max_backoff_s=10, max_restarts=2, window_s=0.5)
    starts: list[float] = []
    launch = launcher("import time; time.sleep(0.4)", starts)
    sup = Supervisor([Process("flaky", launch, launch())], policy, threading.Lock(), 0.02)
    sup.start()
    try:
        time.sleep(4)
        assert sup.failure is None and len(starts) >= 5
    finally:
        sup.stop()
        for p in sup.processes:
            p.popen.kill()
            p.popen.wait()


def test_no_restart_after_stop():
    starts: list[float] = []
    launch = launcher("import time; time.sleep(60)", starts)
    proc = Process("sleeper", launch, launch())
    sup = Supervisor([proc], RestartPolicy(backoff_s=0.01), threading.Lock(), 0.01)
    sup.start()
    sup.stop()
    proc.popen.kill()
    proc.popen.wait()
    time.sleep(0.3)
    assert len(starts) == 1 and sup.pids == [proc.popen.pid]


def stream(url: str, model: str, out: list, i: int, started: threading.Event) -> None:
    """A long streamed completion: ('ok', n) when it finished, ('closed', n) when the
    connection ended early (as the router's death ends it); n chunks, and the seconds from
    the last chunk to the end."""
    body = {
        "model": model,
        "prompt": [40 + i] * 9,
        "max_tokens": 480,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    n, last = 0, time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            for line in resp:
                if line.startswith(b"data: {"):
                    n, last = n + 1, time.monotonic()
                    started.set()
                if line.startswith(b"data: [DONE]"):
                    out.append(("ok", n, time.monotonic() - last))
                    return
    except (OSError, urllib.error.URLError, ValueError):
        pass
    out.append(("closed", n, time.monotonic() - last))


def wait_health(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                workers = json.loads(resp.read())["workers"]
            if all(w["healthy"] for w in workers.values()):
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"not every worker healthy after {timeout_s} s")


def complete(url: str, model: str) -> list[str]:
    bodies = [
        {
            "model": model,
            "prompt": [50 + i] * (7 + 13 * i),
            "max_tokens": 10,
            "temperature": 0,
            "ignore_eos": True,
        }
        for i in range(3)
    ]
    return [post(url, "/v1/completions", b)["choices"][0]["text"] for b in bodies]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_killed_router_and_worker_come_back(tiny_served_model):
    model = str(tiny_served_model)
    pipeline = Pipeline(model=model, port=free_port(), prefill=role(), decode=role(num=2))
    cluster = Cluster(pipeline, log_level="WARNING", restart=RestartPolicy(backoff_s=0.2))
    with cluster as url:
        reference = complete(url, model)
        by_name = {p.name: p for p in cluster.processes}
        # Requests in flight when the router dies: their connections close at once.
        streams: list = []
        started = threading.Event()
        threads = [
            threading.Thread(target=stream, args=(url, model, streams, i, started))
            for i in range(3)
        ]
        for t in threads:
            t.start()
        assert started.wait(30)
        old = {name: by_name[name].popen.pid for name in ("router", "decode-1")}
        os.kill(old["router"], signal.SIGKILL)
        os.kill(old["decode-1"], signal.SIGKILL)
        for t in threads:
            t.join(30)
        assert len(streams) == 3
        for kind, _, tail_s in streams:
            assert kind == "closed" or kind == "ok"  # ok: it finished before the kill
            assert tail_s < 10  # nothing hangs
        assert any(kind == "closed" for kind, _, _ in streams)
        wait_health(url, 120)
        assert {n: by_name[n].popen.pid for n in old} != old  # both are new processes
        assert complete(url, model) == reference
        # The requests of the dead router held blocks on the workers: the new router's Hello
        # made them drop those, so every block is free again.
        blocks = wait_blocks_free(url)
        assert blocks and all(f == t for f, t in blocks.values()), blocks
        assert set(kv_blocks(url)) == {"prefill-0", "decode-0", "decode-1"}
        cluster.check_alive()  # two restarts: well within the budget
    pids = cluster.supervisor.pids
    assert len(pids) == 6  # router, 3 workers, 2 restarts
    assert not [p for p in pids if alive(p)]


def test_a_cluster_that_keeps_dying_is_given_up_on(tiny_served_model):
    pipeline = Pipeline(model=str(tiny_served_model), port=free_port(), collocated=role())
    policy = RestartPolicy(backoff_s=0.1, max_restarts=1, window_s=600)
    cluster = Cluster(pipeline, log_level="WARNING", restart=policy)
    with cluster:
        for _ in range(2):
            worker = next(p for p in cluster.processes if p.name == "collocated-0")
            pid = worker.popen.pid
            worker.popen.kill()
            deadline = time.monotonic() + 60
            while worker.popen.pid == pid and cluster.supervisor.failure is None:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        time.sleep(0.5)
        with pytest.raises(ClusterError, match="collocated-0 was killed by SIGKILL .* after 1 "):
            cluster.check_alive()


def test_a_sigkill_is_named_with_the_last_rss():
    """The OOM killer's SIGKILL reads as a likely out-of-memory death, with the memory the
    process held when last seen, not as a bare exit code."""
    code = "import os, time; b = b'x' * (200 << 20); time.sleep(1); os.kill(os.getpid(), 9)"
    launch = launcher(code, [])
    policy = RestartPolicy(max_restarts=0)
    sup = Supervisor([Process("hog", launch, launch())], policy, threading.Lock(), 0.02)
    sup.start()
    try:
        deadline = time.monotonic() + 30
        while sup.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sup.failure and "hog was killed by SIGKILL (out of memory? its RSS was 0.2" in (
            sup.failure
        )
    finally:
        sup.stop()
