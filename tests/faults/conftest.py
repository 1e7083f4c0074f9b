"""A real 2 prefill + 2 decode cluster whose workers tests may stop, kill and bring back.

Its launcher does not restart dead workers (`restart=None`: the tests decide when), and
`heal()` starts the dead ones again (same id, address and cluster secret): the router
sees them reconnect and announce a new epoch. Workers run as `tests/faults/faulty_worker.py`,
the product's worker with a fault-injecting KV data path: `inject(fault)` writes the file one
request will claim.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import requests

from pdserve.cluster.config import Pipeline, WorkerGroup
from pdserve.cluster.launcher import Cluster, free_port, worker_specs
from tests.cluster.conftest import KV_BYTES

ROOT = Path(__file__).resolve().parents[2]  # the repository, so `tests` imports in workers
WORKERS = ("prefill-0", "prefill-1", "decode-0", "decode-1")
END_BOUND_S = 15.0  # every request ends (completed or a clear error) within this


class FaultCluster(Cluster):
    def __init__(self, pipeline: Pipeline, fault_file: Path) -> None:
        super().__init__(pipeline, log_level="WARNING", restart=None)  # the tests heal
        self.fault_file = fault_file

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> None:
        if args[0] == "pdserve.workers.main":
            args = ["tests.faults.faulty_worker", str(self.fault_file), *args[1:]]
            path = [str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
            env = {**env, "PYTHONPATH": os.pathsep.join(path)}
        super()._spawn(name, args, env)

    def process(self, name: str) -> subprocess.Popen:
        return next(p.popen for p in self.processes if p.name == name)

    def signal(self, names: tuple[str, ...] | list[str], sig: int) -> None:
        for name in names:
            self.process(name).send_signal(sig)
        if sig == signal.SIGKILL:
            for name in names:
                self.process(name).wait(5)

    def inject(self, fault: str) -> None:
        self.fault_file.write_text(fault)

    def heal(self, timeout_s: float = 60.0) -> None:
        """Continue stopped workers, respawn dead ones, wait until the router sees all."""
        self.fault_file.unlink(missing_ok=True)
        for proc in list(self.processes):
            if proc.name == "router":
                continue
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGCONT)
                continue
            proc.popen = proc.launch()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            metrics = requests.get(self.url + "/metrics", timeout=5).text
            healthy = re.findall(r'pdserve_worker_healthy\{worker="([^"]+)"\} 1', metrics)
            if set(healthy) == set(WORKERS):
                return
            time.sleep(0.3)
        raise AssertionError(f"workers not all healthy after {timeout_s} s: {healthy}")


def kv_blocks(url: str) -> dict[str, tuple[int, int]]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    free = dict(re.findall(r'pdserve_kv_blocks_free\{worker="([^"]+)"\} (\d+)', text))
    total = dict(re.findall(r'pdserve_kv_blocks_total\{worker="([^"]+)"\} (\d+)', text))
    healthy = re.findall(r'pdserve_worker_healthy\{worker="([^"]+)"\} 1', text)
    return {w: (int(free[w]), int(total[w])) for w in healthy}


def router_active(url: str) -> dict[str, int]:
    text = requests.get(url + "/metrics", timeout=5).text
    pairs = re.findall(r'pdserve_router_active_requests\{worker="([^"]+)"\} (\d+)', text)
    return {w: int(n) for w, n in pairs}


def counted(url: str, name: str, **labels: str) -> float:
    """The sum of counter `name`'s samples on /metrics whose labels include `labels`."""
    text = requests.get(url + "/metrics", timeout=5).text
    total = 0.0
    for found, value in re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.MULTILINE):
        pairs = set(re.findall(r'(\w+)="([^"]*)"', found))
        total += float(value) if set(labels.items()) <= pairs else 0.0
    return total


def assert_blocks_back(url: str, timeout_s: float = 12.0) -> None:
    """Every surviving worker's free blocks return to its total (the baseline: all free,
    cached prefix blocks included), within the send and land deadlines plus a margin."""
    deadline = time.monotonic() + timeout_s
    while True:
        blocks = kv_blocks(url)
        if blocks and all(free == total for free, total in blocks.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"KV blocks not back to baseline: {blocks}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster(tiny_served_model, tmp_path_factory):
    fault_file = tmp_path_factory.mktemp("faults") / "fault"
    role = WorkerGroup(kv_cache_bytes=KV_BYTES, threads=1, num=2, long_prefill_token_threshold=32)
    pipeline = Pipeline(model=str(tiny_served_model), port=free_port(), prefill=role, decode=role)
    assert [s.worker_id for s in worker_specs(pipeline, "x")] == list(WORKERS)
    c = FaultCluster(pipeline, fault_file)
    with c:
        yield c
