"""The worker's entry point (pdserve/workers/main.py): once its Worker has closed, the
process exits at once, not after the interpreter's last collection over every object it made
(seconds for a real model's worker, past the launcher's 5 s grace before SIGKILL)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from pdserve.config import EngineConfig
from pdserve.workers.spec import WorkerSpec

# A stand-in Worker whose run() leaves a heap of reference cycles behind, as a model, its
# tokenizer and torch do: only the cyclic collector could visit them. It prints how long
# one collection over them takes, then returns (as run() does after SIGTERM). A witness in
# one more cycle prints "collected" if the interpreter's last collection reaches it.
CHILD = """
import gc, sys, time, types
class Witness:
    def __del__(self):
        print("collected", flush=True)
class Worker:
    def __init__(self, spec, secret):
        self.running = True
    def run(self):
        global heap
        heap = [[] for _ in range(1_500_000)]
        for x in heap:
            x.append(x)
        start = time.perf_counter()
        gc.collect()
        global witness  # in a cycle: only a collection would run its __del__
        witness = Witness()
        witness.me = witness
        print(time.perf_counter() - start, time.time(), flush=True)
fake = types.ModuleType("pdserve.workers.worker")
fake.Worker = Worker
sys.modules["pdserve.workers.worker"] = fake
from pdserve.workers.main import main
sys.exit(main(["--spec", sys.argv[1]]))
"""


def test_the_process_exits_without_collecting_what_its_worker_made(tmp_path):
    spec = WorkerSpec("w0", "decode", EngineConfig(model="m"), "ipc://a", "ipc://b")
    env = {**os.environ, "PDSERVE_CLUSTER_SECRET": "ab" * 16}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, spec.to_json()], stdout=subprocess.PIPE, text=True, env=env
    )
    collect_s, returned_at = map(float, child.stdout.readline().split())
    assert child.wait(30) == 0
    exit_s = time.time() - returned_at
    assert "collected" not in child.stdout.read()  # no collection at exit
    # The time it saves: this heap's collection, ~0.05 s on a quiet machine, ~0.3 s loaded
    # (the floor keeps a quiet machine's interpreter teardown from failing it).
    assert exit_s < max(collect_s / 2, 0.25), (exit_s, collect_s)
