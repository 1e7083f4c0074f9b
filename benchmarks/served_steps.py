"""Served steps against a profile (docs/simulator.md, "Served steps"): each step of a
`PDSERVE_STEP_TRACE` folder over what the profile's served cost model predicts, by worker and
kind of step. `--pairs`: a 1P1D prefill worker's step against a lone one-thread engine's on the
same core, interleaved pairs, the median ratio in wall and in the thread's CPU time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import tempfile
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
    args = parser.parse_args()
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
