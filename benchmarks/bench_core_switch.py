"""What moving a worker's cores costs (SetCores, the adaptive planner's core groups), on a real
worker process driven by this script as its router.

    .venv/bin/python benchmarks/bench_core_switch.py [--model smollm2-135m] [--repeats 20]
        [--batch 8] [--prompt-tokens 64]

The worker runs on every core of this process (at least two). It alternates between "wide"
(every core, one thread each) and "narrow" (the first core, one thread), and prints medians:
  - idle: SetCores sent -> CoresSet received (round trip) and the worker's own switch_s;
  - mid-decode (`--batch` requests decoding): the same, the step in progress included;
  - first step after a thread-count change against the steady steps of that count (decode
    steps of the same batch, from StepReport rows), as a ratio;
  - park / unpark mid-decode: unpark sent -> the next token, against the median inter-token
    time while decoding;
  - StepReport's bookkeeping per step (StepShape.of a 32-request batch + one row), in-process.
Run it on a quiet machine; timing under other load is noise.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import zmq

from pdserve import envs
from pdserve import messages as m
from pdserve.config import EngineConfig
from pdserve.perf.cost_model import StepShape
from pdserve.workers.spec import WorkerSpec
from pdserve.workers.step_report import StepLog


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Driver:
    """One worker process and the router's two sockets; keeps every Tokens arrival time and
    every StepReport row (rows arrive in step order)."""

    def __init__(self, model: str, cpus: list[int]) -> None:
        self.secret = secrets.token_bytes(32)
        self.signer, self.verifier = m.Signer(self.secret), m.Verifier(self.secret)
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        port = self.inbox.bind_to_random_port("tcp://127.0.0.1")
        ctrl = f"tcp://127.0.0.1:{free_port()}"
        engine = EngineConfig(model=model)
        spec = WorkerSpec(worker_id="w", role="collocated", engine=engine, ctrl_address=ctrl,
                          router_address=f"tcp://127.0.0.1:{port}", cpus=tuple(cpus),
                          adaptive=True)  # fmt: skip
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "pdserve.workers.main", "--spec", spec.to_json(),
             "--log-level", "WARNING"], env=envs.child_env(self.secret),
        )  # fmt: skip
        self.ctrl = self.ctx.socket(zmq.PUSH)
        self.ctrl.connect(ctrl)
        self.token_times: list[float] = []
        self.rows: list[list[float]] = []
        self.until(m.Ready, timeout_s=600)

    def send(self, message: Any) -> None:
        self.ctrl.send(self.signer.encode(message))

    def _take(self, timeout_s: float) -> Any | None:
        if self.popen.poll() is not None:
            raise RuntimeError(f"worker exited with {self.popen.returncode}")
        if not self.inbox.poll(max(1, int(timeout_s * 1000))):
            return None
        message = self.verifier.decode(self.inbox.recv())
        if isinstance(message, m.Tokens):
            self.token_times.append(time.perf_counter())
        elif isinstance(message, m.StepReport):
            self.rows += message.steps
        return message

    def until(self, kind: type, timeout_s: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if isinstance(message := self._take(min(left, 0.1)), kind):
                return message
        raise TimeoutError(f"no {kind.__name__} within {timeout_s} s")

    def set_cores(self, cpus: list[int], threads: int) -> tuple[float, float]:
        """(round trip s, the worker's switch_s)."""
        start = time.perf_counter()
        self.send(m.SetCores(cpus, threads))
        done = self.until(m.CoresSet)
        assert done.threads == threads, f"SetCores({cpus}, {threads}) refused"
        return time.perf_counter() - start, done.switch_s

    def pump(self, seconds: float) -> None:
        """Take messages for `seconds`."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            self._take(left)

    def close(self) -> None:
        self.send(m.Shutdown())
        try:
            self.popen.wait(30)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
        self.ctx.destroy(0)


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:8.3f} ms" if values else "       -"


def switches(d: Driver, configs: list[tuple[list[int], int]], repeats: int, gap_s: float) -> dict:
    """Round trips and switch_s per target configuration, cycling through `configs`."""
    out: dict[str, dict[str, list[float]]] = {}
    for _ in range(repeats):
        for cpus, threads in configs:
            rtt, switch_s = d.set_cores(cpus, threads)
            entry = out.setdefault(f"{threads} thread(s) on {cpus}", {"rtt": [], "switch": []})
            entry["rtt"].append(rtt)
            entry["switch"].append(switch_s)
            d.pump(gap_s)
    return out


def first_step_ratios(rows: list[list[float]]) -> dict[int, list[float]]:
    """Per thread count: each first decode step after a change to it, over the median of the
    other decode steps with that count and batch."""
    decode = [r for r in rows if r[0] == 0 and r[1] > 0]
    steady: dict[tuple[int, int], list[float]] = {}
    firsts: list[tuple[int, int, float]] = []
    for prev, row in zip([None, *decode], decode):
        key = (int(row[4]), int(row[1]))
        if prev is not None and prev[4] != row[4]:
            firsts.append((*key, row[5]))
        else:
            steady.setdefault(key, []).append(row[5])
    ratios: dict[int, list[float]] = {}
    for threads, batch, seconds in firsts:
        if steady.get((threads, batch)):
            ratios.setdefault(threads, []).append(
                seconds / statistics.median(steady[(threads, batch)])
            )
    return ratios


def bookkeeping_us(num_requests: int = 32, repeats: int = 2000) -> float:
    requests = [SimpleNamespace(num_computed_tokens=200 + i, num_dropped_tokens=0,
                                num_prompt_tokens=100) for i in range(num_requests)]  # fmt: skip
    scheduled = [(r, 1) for r in requests]
    log = StepLog("w")
    start = time.perf_counter()
    for i in range(repeats):
        log.record(StepShape.of(scheduled), 2, 0.01, float(i))
        log.due(float(i))
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        sys.exit("needs at least two cores")
    wide, narrow = (cores, len(cores)), (cores[:1], 1)
    d = Driver(args.model, cores)
    try:
        idle = switches(d, [narrow, wide], args.repeats, 0.02)
        prompt = [(7 * i) % 1000 + 10 for i in range(args.prompt_tokens)]
        params = {"max_tokens": 100_000, "temperature": 0.0, "ignore_eos": True}
        for i in range(args.batch):
            d.send(m.Generate(f"r{i}", [i + 1, *prompt], params))
        d.pump(3.0)  # prefills done, decoding steadily
        d.rows.clear()
        busy = switches(d, [narrow, wide], args.repeats, 0.5)
        d.pump(0.5)  # the last StepReport
        ratios = first_step_ratios(d.rows)
        steady = [r[5] for r in d.rows if r[0] == 0 and r[1] == args.batch and r[4] == wide[1]]
        resume = []
        for _ in range(args.repeats):
            d.set_cores([], 0)
            d.pump(0.2)
            n = len(d.token_times)
            start = time.perf_counter()
            d.send(m.SetCores(*wide))
            while len(d.token_times) == n:
                d.until(m.Tokens)
            resume.append(d.token_times[n] - start)
            d.pump(0.1)
        for i in range(args.batch):
            d.send(m.Abort(f"r{i}"))
    finally:
        d.close()
    print(f"cores {cores}, model {args.model}, batch {args.batch}, repeats {args.repeats}")
    print(f"{'switch to':32} {'idle rtt':>11} {'idle switch_s':>14} {'decode rtt':>11} "
          f"{'decode switch_s':>16}")  # fmt: skip
    for name in idle:
        print(f"{name:32} {ms(idle[name]['rtt'])} {ms(idle[name]['switch']):>14} "
              f"{ms(busy[name]['rtt'])} {ms(busy[name]['switch']):>16}")  # fmt: skip
    for threads, values in sorted(ratios.items()):
        print(f"first decode step at {threads} thread(s) / steady: "
              f"{statistics.median(values):.2f}x (median of {len(values)})")  # fmt: skip
    print(f"unpark -> next token {ms(resume)}; a steady decode step at {wide[1]} threads "
          f"{ms(steady)} (batch of {args.batch})")  # fmt: skip
    overhead = bookkeeping_us()
    print(f"StepReport bookkeeping per step (batch 32): {overhead:.1f} us")
    result = {
        "idle": {k: {x: statistics.median(v) for x, v in e.items()} for k, e in idle.items()},
        "decode": {k: {x: statistics.median(v) for x, v in e.items()} for k, e in busy.items()},
        "first_step_ratio": {t: statistics.median(v) for t, v in ratios.items()},
        "unpark_to_token_s": statistics.median(resume),
        "steady_step_s": statistics.median(steady) if steady else None,
        "bookkeeping_us": overhead,
    }
    print("JSON", json.dumps(result))


if __name__ == "__main__":
    main()
