"""SetCores on a real worker process: every thread moves, a parked worker runs no step,
cores outside the pool are refused."""

from __future__ import annotations

import os
import threading
import time

import torch

from pdserve import messages as m
from pdserve.workers.cores import Cores, pin_threads

GREEDY = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}


def tokens_of(worker, request_id: str) -> list[int]:
    ids: list[int] = []
    while True:
        t = worker.expect(m.Tokens, timeout_s=30, request_id=request_id)
        ids += t.token_ids
        if t.finished:
            return ids


def set_cores(worker, cpus: list[int], threads: int) -> m.CoresSet:
    worker.send(m.SetCores(cpus, threads))
    return worker.expect(m.CoresSet)


def test_cores_apply_sets_torch_threads_and_every_threads_affinity(two_cores):
    first, second = two_cores
    before = os.sched_getaffinity(0)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)  # started before the switch
    other.start()
    try:
        cores = Cores(two_cores)
        cores.apply([second], 1)
        assert torch.get_num_threads() == 1
        assert os.sched_getaffinity(other.native_id) == {second} == os.sched_getaffinity(0)
        cores.apply([first, second], 2)
        assert torch.get_num_threads() == 2
        assert os.sched_getaffinity(other.native_id) == {first, second}
        assert (cores.cpus, cores.threads) == ([first, second], 2)
    finally:
        stop.set()
        other.join()
        pin_threads(before)
        torch.set_num_threads(1)


def test_ready_reports_the_cores_it_starts_on(worker, two_cores):
    assert (worker.ready.cpus, worker.ready.threads) == (list(two_cores), 2)


def test_set_cores_moves_every_thread_of_the_process(worker, two_cores):
    first, second = two_cores
    done = set_cores(worker, [first, second], 2)
    assert (done.cpus, done.threads) == ([first, second], 2) and done.switch_s > 0
    num_threads = len(worker.affinities())
    assert num_threads >= 4  # main, heartbeat, ZMQ I/O, OpenMP
    done = set_cores(worker, [second], 1)
    assert (done.cpus, done.threads) == ([second], 1)
    affinities = worker.affinities()
    assert len(affinities) >= num_threads  # the OpenMP threads of 2 threads still exist
    assert set(map(frozenset, affinities.values())) == {frozenset({second})}


def test_set_cores_outside_the_pool_or_over_the_cpus_is_refused(worker, two_cores):
    first, second = two_cores
    set_cores(worker, [first], 1)
    outside = max(two_cores) + 1
    for cpus, threads in (([first, outside], 1), ([first], 2), ([first], -1)):
        done = set_cores(worker, cpus, threads)
        assert (done.cpus, done.threads) == ([first], 1)
    assert set(map(frozenset, worker.affinities().values())) == {frozenset({first})}


def test_parked_worker_runs_no_step_and_finishes_once_given_cores(worker, two_cores):
    first, _ = two_cores
    set_cores(worker, [first], 1)
    prompt = list(range(3, 40))
    worker.send(m.Generate("reference", prompt, GREEDY))
    reference = tokens_of(worker, "reference")
    assert set_cores(worker, [], 0).threads == 0
    worker.send(m.Generate("parked", prompt, GREEDY))
    worker.send(m.Abort("never-sent"))
    worker.expect(m.Released, request_id="never-sent")  # control messages are still served
    cpu_before = worker.cpu_seconds()
    assert worker.received(m.Tokens, timeout_s=1.0) == []
    assert worker.cpu_seconds() - cpu_before < 0.2  # parked, the loop blocks on its socket
    assert set_cores(worker, [first], 1).threads == 1
    assert tokens_of(worker, "parked") == reference


def test_step_report_rows_are_the_steps_run(worker, two_cores):
    first, second = two_cores
    set_cores(worker, [first, second], 2)
    worker.received(m.StepReport, timeout_s=0.5)  # rows of earlier tests
    prompt = list(range(50, 70))  # shares no prefix with the other tests' prompts
    start, first = time.monotonic(), len(worker.seen)
    worker.send(m.Generate("reported", prompt, {**GREEDY, "max_tokens": 5}))
    assert len(tokens_of(worker, "reported")) == 5
    worker.received(m.StepReport, timeout_s=1.0)  # the last rows
    reports = [r for r in worker.seen[first:] if isinstance(r, m.StepReport)]
    rows = [row for r in reports for row in r.steps]
    elapsed = time.monotonic() - start
    # one prefill step of the whole prompt (one row), then 4 decode steps attending 21..24
    assert [row[:6] for row in rows] == [
        [20, 0, 20 * 21 / 2, 0, 1, 2],
        *([0, 1, 0, context, 0, 2] for context in range(21, 25)),
    ]
    assert all(0 < row[6] < elapsed for row in rows)
