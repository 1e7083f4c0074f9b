"""Served steps against a profile (docs/simulator.md, "Served steps"): each step of a
`PDSERVE_STEP_TRACE` folder over what the profile's served cost model predicts, by worker and
kind of step. `--pairs`: a 1P1D prefill worker's step against a lone one-thread engine's on the
same core, interleaved pairs, the median ratio in wall and in the thread's CPU time.
`--pairs --decode B`: a collocated worker's decode steps at batch B (B streams at once) against a
lone engine's on the same cores and threads, interleaved rounds: the step's wall and thread CPU,
the time between two steps (the worker's loop: Tokens out, control messages in), start to start,
and the worker's CPU a token by thread (its loop outside the steps, the ZMQ I/O thread, the
heartbeat).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from pdserve import envs
from pdserve.costmodel.profile import load_profile
from pdserve.costmodel.step_cost import StepShape
from pdserve.workers.step_report import read_trace

IDLE_S = 1.0  # longer than any gap between a busy worker's steps
KV_CACHE_BYTES = 1 << 30


def kind(shape: StepShape, idle_s: float) -> str:
    if shape.prefill_tokens and shape.decode_requests:
        return "mixed"
    if shape.prefill_tokens:
        return "prefill after idle" if idle_s > IDLE_S else "prefill back to back"
    return f"decode batch {shape.decode_requests if shape.decode_requests < 4 else '4+'}"


def lone_engine(model: str, conn) -> None:
    """A one-thread engine on the first core in a process of its own, as a worker runs (no
    thread of the benchmark's waits beside it): its vocabulary size once ready, then for each
    prompt length received one prefill step timed, (wall, thread CPU seconds); None ends it."""
    from pdserve.perf.measure import ProfileConfig, pinned_engine, timing_env
    from pdserve.sampling_params import SamplingParams

    timing_env()  # before torch loads: it waits for work as a worker does
    cfg = ProfileConfig(model=model, threads=(1,), kv_cache_bytes=KV_CACHE_BYTES)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(1)
    with pinned_engine(cfg, 1) as engine:
        conn.send(engine.model_config.vocab_size)  # ready
        while (tokens := conn.recv()) is not None:
            prompt = rng.integers(200, engine.model_config.vocab_size, tokens).tolist()
            engine.add_request(f"p{time.monotonic_ns()}", prompt, params)
            wall, cpu = time.perf_counter(), time.thread_time()
            engine.step()
            conn.send((time.perf_counter() - wall, time.thread_time() - cpu))
            while engine.has_unfinished_requests():
                engine.step()


def lone_decodes(model: str, threads: int, conn) -> None:
    """An engine on the first `threads` cores in a process of its own, under a worker's OpenMP
    wait policy: ready once loaded, then for each (batch, prompt length, new tokens) received
    that many greedy requests run to the end, every step sent back as a `step_row`; None ends
    it."""
    from pdserve.perf.measure import ProfileConfig, pinned_engine, timing_env
    from pdserve.sampling_params import SamplingParams

    timing_env()
    cfg = ProfileConfig(model=model, threads=(threads,), kv_cache_bytes=KV_CACHE_BYTES)
    rng = np.random.default_rng(1)
    with pinned_engine(cfg, threads) as engine:
        conn.send(engine.model_config.vocab_size)
        while (job := conn.recv()) is not None:
            batch, prompt_len, new_tokens = job
            params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
            for i in range(batch):
                prompt = rng.integers(200, engine.model_config.vocab_size, prompt_len).tolist()
                engine.add_request(f"d{time.monotonic_ns()}-{i}", prompt, params)
            rows = []
            while engine.has_unfinished_requests():
                wall, cpu = time.perf_counter(), time.thread_time()
                engine.step()
                seconds, cpu = time.perf_counter() - wall, time.thread_time() - cpu
                rows.append(step_row(engine.last_shape, wall, seconds, cpu))
            conn.send(rows)


def step_row(shape: StepShape, start: float, seconds: float, cpu: float) -> tuple:
    """(start, seconds, thread CPU seconds, decode requests, prefill tokens) of one step."""
    return start, seconds, cpu, shape.decode_requests, shape.prefill_tokens


def decode_figures(rows: list[tuple], batch: int) -> tuple[float, float, float, float]:
    """Medians over the steps that decode `batch` requests and nothing else: (step wall,
    step thread CPU, time from its end to the next such step's start, start to start)."""
    full = [r[3] == batch and not r[4] for r in rows]
    if not any(full):
        raise RuntimeError(f"no step decoded {batch} requests alone (of {len(rows)} steps)")
    nexts = [(a, b) for i, (a, b) in enumerate(zip(rows, rows[1:])) if full[i] and full[i + 1]]
    return (
        statistics.median(r[1] for r, f in zip(rows, full) if f),
        statistics.median(r[2] for r, f in zip(rows, full) if f),
        statistics.median(b[0] - a[0] - a[1] for a, b in nexts),
        statistics.median(b[0] - a[0] for a, b in nexts),
    )


def thread_cpu_s(pid: int) -> dict[int, tuple[str, float]]:
    """Each thread of process `pid`: (its name, CPU seconds so far, from schedstat's ns)."""
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            ns = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except OSError:  # the thread ended
            continue
        found[int(tid)] = (stat[stat.index("(") + 1 : stat.rindex(")")], ns / 1e9)
    return found


def decode_pairs(model: str, batch: int, new_tokens: int, rounds: int) -> int:
    from pdserve.cluster.deployments import pipeline_for
    from pdserve.cluster.launcher import Cluster
    from pdserve.perf.machine import cpu_name
    from pdserve.perf.served import first_token

    threads, prompt_len = len(os.sched_getaffinity(0)), 32
    job = (batch, prompt_len, new_tokens)
    conn, child = multiprocessing.get_context("spawn").Pipe()
    engine = multiprocessing.get_context("spawn").Process(
        target=lone_decodes, args=(model, threads, child)
    )
    engine.start()
    vocab, rng, lone, served = conn.recv(), np.random.default_rng(0), [], []
    worker_cpu: dict[int, list[float]] = {}  # per thread: CPU seconds a token, each round
    thread_names: dict[int, str] = {}
    loop_cpu = []  # the worker's main thread outside its steps, a token
    try:
        with tempfile.TemporaryDirectory() as tmp, envs.step_trace(Path(tmp)):
            cluster = Cluster(
                pipeline_for("collocated", model, KV_CACHE_BYTES), log_level="WARNING"
            )
            with cluster as url:
                pid = next(p.popen.pid for p in cluster.processes if p.name != "router")
                trace, done = None, 0
                for _ in range(rounds + 1):  # the first round of each side warms up
                    time.sleep(0.1)
                    conn.send(job)
                    lone.append(decode_figures(conn.recv(), batch))
                    time.sleep(0.1)
                    before = thread_cpu_s(pid)
                    prompts = [rng.integers(200, vocab, prompt_len).tolist() for _ in range(batch)]
                    streams = [
                        threading.Thread(target=first_token, args=(url, model, p, new_tokens))
                        for p in prompts
                    ]
                    for t in streams:
                        t.start()
                    for t in streams:
                        t.join()
                    after = thread_cpu_s(pid)
                    trace = trace or next(Path(tmp).glob("collocated*.steps.jsonl"))
                    lines = trace.read_text().splitlines()
                    rows = [
                        (r["start"], r["seconds"], r["cpu_seconds"])
                        + (r["decode_requests"], r["prefill_tokens"])
                        for r in map(json.loads, lines[done:])
                    ]
                    done = len(lines)
                    served.append(decode_figures(rows, batch))
                    tokens = batch * new_tokens
                    for tid, (name, cpu) in after.items():
                        thread_names[tid] = name
                        spent = (cpu - before.get(tid, (name, 0.0))[1]) / tokens
                        worker_cpu.setdefault(tid, []).append(spent)
                    main = after[pid][1] - before[pid][1]
                    loop_cpu.append((main - sum(r[2] for r in rows)) / tokens)
    finally:
        conn.send(None)
        engine.join()
    lone, served, loop_cpu = lone[1:], served[1:], loop_cpu[1:]
    print(
        f"{cpu_name()}, load {os.getloadavg()[0]:.2f}, {threads} threads, batch {batch}, "
        f"{new_tokens} tokens a request, {envs.cpu_isa()} kernels, ms, medians of {rounds} rounds"
    )
    names = ("step wall", "step CPU", "between", "per step")
    for i, what in enumerate(names):
        ratio = statistics.median(s[i] / a[i] for a, s in zip(lone, served, strict=True))
        print(
            f"{what:>10}: served worker {statistics.median(s[i] for s in served) * 1e3:8.3f}"
            f"  lone engine {statistics.median(a[i] for a in lone) * 1e3:8.3f}  ratio {ratio:.3f}"
        )
    print(
        "worker CPU a token, ms: its loop outside the steps "
        f"{statistics.median(loop_cpu) * 1e3:.3f}"
    )
    for tid, per_round in sorted(worker_cpu.items()):
        if len(per_round) == rounds + 1 and (cpu := statistics.median(per_round[1:])) >= 1e-5:
            main = ", main" if tid == pid else ""
            print(f"  thread {tid} ({thread_names[tid]}{main}): {cpu * 1e3:.3f}")
    return 0


def pairs(model: str, tokens: int, rounds: int) -> int:
    from pdserve.cluster.deployments import pipeline_for
    from pdserve.cluster.launcher import Cluster
    from pdserve.perf.machine import cpu_name
    from pdserve.perf.served import first_token

    conn, child = multiprocessing.get_context("spawn").Pipe()
    engine = multiprocessing.get_context("spawn").Process(target=lone_engine, args=(model, child))
    engine.start()
    vocab, rng, lone = conn.recv(), np.random.default_rng(0), []
    try:
        with tempfile.TemporaryDirectory() as tmp, envs.step_trace(Path(tmp)):
            with Cluster(pipeline_for("1p1d", model, KV_CACHE_BYTES), log_level="WARNING") as url:
                for _ in range(rounds + 1):  # each side's step after 0.1 s of quiet
                    time.sleep(0.1)
                    conn.send(tokens)
                    lone.append(conn.recv())
                    time.sleep(0.1)
                    first_token(url, model, rng.integers(200, vocab, tokens).tolist(), 2)
            rows = [
                json.loads(line)
                for path in Path(tmp).glob("prefill*.steps.jsonl")
                for line in path.read_text().splitlines()
            ]
    finally:
        conn.send(None)
        engine.join()
    served = [
        (r["seconds"], r["cpu_seconds"])
        for r in rows
        if r["prefill_tokens"] == tokens and not r["decode_requests"]
    ]
    lone, served = lone[1:], served[len(served) - rounds :]  # the first pair warms up
    print(
        f"{cpu_name()}, load {os.getloadavg()[0]:.2f}, {tokens}-token prompts, "
        f"{envs.cpu_isa()} kernels, ms, medians of {rounds} pairs"
    )
    for i, what in enumerate(("wall", "thread CPU")):
        ratio = statistics.median(s[i] / a[i] for a, s in zip(lone, served, strict=True))
        print(
            f"{what:>10}: prefill worker {statistics.median(s[i] for s in served) * 1e3:7.1f}"
            f"  lone engine {statistics.median(a[i] for a in lone) * 1e3:7.1f}"
            f"  ratio {ratio:.3f}"
        )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", nargs="?", help="the PDSERVE_STEP_TRACE folder")
    parser.add_argument("--profile")
    parser.add_argument("--pairs", action="store_true", help="against a lone engine's prefill")
    parser.add_argument("--model", default="smollm2-135m", help="--pairs: the model")
    parser.add_argument("--tokens", type=int, default=32, help="--pairs: prompt length")
    parser.add_argument("--rounds", type=int, default=9, help="--pairs: pairs counted")
    parser.add_argument("--decode", type=int, help="--pairs: decode steps at this batch instead")
    parser.add_argument("--new-tokens", type=int, default=48, help="--decode: tokens a request")
    args = parser.parse_args()
    if args.pairs and args.decode:
        return decode_pairs(args.model, args.decode, args.new_tokens, args.rounds)
    if args.pairs:
        return pairs(args.model, args.tokens, args.rounds)
    if not args.trace or not args.profile:
        parser.error("a trace folder and --profile, or --pairs")
    return against_profile(args.trace, load_profile(args.profile))


def against_profile(trace: str, profile) -> int:
    token_cpu_s = profile.served.token_cpu_s
    print(
        f"{'worker/threads':18} {'kind':22} {'steps':>6} {'measured ms':>12} {'predicted':>10} "
        f"{'ratio':>6} {'+cpu':>6}"
    )
    for path in sorted(Path(trace).glob("*.steps.jsonl")):
        by_kind: dict[tuple[int, str], list[tuple[float, float, float]]] = {}
        last_end = None
        # a worker id is its role's name and an index (cluster/launcher.py)
        role = path.name.split("-")[0]
        for shape, threads, start, seconds in read_trace(path):
            predicted = profile.served_cost_model(threads, role).predict(shape)
            idle_s = start - last_end if last_end is not None else float("inf")
            last_end = start + seconds
            with_cpu = predicted + token_cpu_s * shape.decode_requests
            key = (threads, kind(shape, idle_s))
            by_kind.setdefault(key, []).append((seconds, predicted, with_cpu))
        for (threads, name), rows in sorted(by_kind.items()):
            worker = f"{path.name.removesuffix('.steps.jsonl')}/{threads}t"
            ratio = statistics.median(s / p for s, p, _ in rows)
            with_cpu = statistics.median(s / c for s, _, c in rows)
            print(
                f"{worker:18} {name:22} {len(rows):6d} "
                f"{statistics.median(s for s, _, _ in rows) * 1e3:12.1f} "
                f"{statistics.median(p for _, p, _ in rows) * 1e3:10.1f} "
                f"{ratio:6.3f} {with_cpu:6.3f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
