"""`ServedSteps`: how a served worker's steps compare with its cost model, measured by
`pdserve profile` from the steps real workers run under a load of requests.

Timed alone, the engine has its cores to itself. Served, the router and the client take
CPU from them, and workers on the other cores share the memory bandwidth and the caches:
on an AMD EPYC (2 cores) a one-thread worker of two ran its chat prefills 15-20% over its
model, a two-thread worker its prefills 50-100 ms over whatever their length
(docs/simulator.md, "Profiles", *Served steps*). So for each size the profile has, one deployment of
workers that size fills the host's cores (one all-core collocated worker; one one-thread
worker per core), `pdserve bench` sends it a Poisson load of chat-like requests at
SERVED_LOAD of what the model says it serves, every worker writes its steps
(`PDSERVE_STEP_TRACE`), and each phase's steps give a line, measured against predicted
(`fit_line`). Each step is first cleared of what the simulator prices on its own: the wake
curve after idle, and `token_cpu_s` per token where every core was busy.

Torch-free itself (the workers are processes); imported by perf/measure.py only.
"""

from __future__ import annotations

import bisect
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from pdserve import envs
from pdserve.costmodel.step_cost import ServedSteps, StepCostModel, StepShape
from pdserve.perf.served import run_bench
from pdserve.workers.step_report import read_trace

SERVED_LOAD = 0.6  # the load's rate, as a fraction of what the model says the workers serve
SERVED_LOAD_REQUESTS = 24  # requests per deployment, after WARMUP_REQUESTS
WARMUP_REQUESTS = 2  # sent one at a time first; their steps are not counted
LOAD_INPUT = "lognormal:256:0.8"  # chat's prompts (`--preset chat`): 30 to 2,000 tokens
LOAD_OUTPUT = "lognormal:48:0.5"  # shorter answers than chat's: the run takes a minute or two
MIN_STEPS = 4  # a phase with fewer steps keeps the model (factor 1)
MIN_SPREAD = 2.0  # a line needs its halves' predictions this far apart; else a factor alone

Step = tuple[StepShape, int, float, float]  # shape, threads, start, seconds (read_trace)


def measure_served_steps(
    model: str,
    kv_cache_bytes: int | None,
    models: dict[int, StepCostModel],
    token_cpu_s: float,
    log=lambda line: None,
) -> dict[int, ServedSteps]:
    """`ServedSteps` for each size of `models` that fills the host's cores with workers of
    that size (one all-core worker, or one per core for one thread)."""
    from pdserve.cluster.config import Pipeline, WorkerGroup
    from pdserve.cluster.launcher import Cluster, free_port

    cores = sorted(os.sched_getaffinity(0))
    lines = {}
    for size in sorted(models):
        if len(cores) % size:
            continue
        groups = [tuple(cores[i : i + size]) for i in range(0, len(cores), size)]
        role = WorkerGroup(
            num=len(groups), cpus=groups, threads=size, kv_cache_bytes=kv_cache_bytes
        )
        pipeline = Pipeline(
            model=model, collocated=role, routing="shortest_queue", port=free_port()
        )
        rate = SERVED_LOAD * len(groups) / request_s(models[size])
        with tempfile.TemporaryDirectory() as tmp, envs.step_trace(Path(tmp)):
            with Cluster(pipeline, log_level="WARNING") as url:
                # as the accuracy runs send: one at a time to warm up, then Poisson at `rate`
                run_bench(
                    url,
                    model,
                    WARMUP_REQUESTS,
                    LOAD_INPUT,
                    LOAD_OUTPUT,
                    "--max-concurrency",
                    "1",
                    "--seed",
                    str(WARMUP_REQUESTS),
                )
                start = time.time()
                run_bench(
                    url,
                    model,
                    SERVED_LOAD_REQUESTS,
                    LOAD_INPUT,
                    LOAD_OUTPUT,
                    "--rate",
                    f"{rate:.6f}",
                    "--seed",
                    str(SERVED_LOAD_REQUESTS),
                )
            traces = [read_trace(p) for p in sorted(Path(tmp).glob("*.steps.jsonl"))]
        lines[size] = fit_served_steps(models[size], traces, len(cores), token_cpu_s, start)
        s = lines[size]
        log(
            f"served steps, {len(groups)} x {size} threads at {rate:.3f} req/s: prefill "
            f"{s.prefill_s * 1e3:.1f} ms + x{s.prefill_factor:.3f}, decode "
            f"{s.decode_s * 1e3:.1f} ms + x{s.decode_factor:.3f} the model's"
        )
    return lines


def request_s(model: StepCostModel) -> float:
    """A mean load request's service time on one worker alone: its prefill and its decodes
    at batch 1 (the load's mean lengths)."""
    prompt, answer = (int(spec.split(":")[1]) for spec in (LOAD_INPUT, LOAD_OUTPUT))
    prefill = model.predict(StepShape(prompt, 0, prompt * (prompt + 1) / 2, 0, 1))
    decode = model.predict(StepShape(0, 1, 0.0, prompt + answer // 2))
    return prefill + answer * decode


def fit_served_steps(
    model: StepCostModel,
    traces: Sequence[Sequence[Step]],
    cores: int,
    token_cpu_s: float,
    since: float = float("-inf"),
) -> ServedSteps:
    """Each phase's line through the workers' steps that started after `since` (one trace
    per worker), each step less its wake cost and, where the busy workers' threads filled
    the host's `cores`, `token_cpu_s` per token it sampled (as the simulator prices it)."""
    busy = [([s[2] for s in t], [s[2] + s[3] for s in t], t[0][1] if t else 0) for t in traces]
    points: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for index, trace in enumerate(traces):
        last_end = float("-inf")
        for shape, threads, start, seconds in trace:
            idle_s, last_end = start - last_end, start + seconds
            if start < since:
                continue
            others = (
                n
                for i, (starts, ends, n) in enumerate(busy)
                if i != index and _busy_at(starts, ends, start)
            )
            taken = threads + sum(others)
            sampled = shape.decode_requests + shape.num_prefill_sequences
            extra = model.wake_s(idle_s) + (token_cpu_s * sampled if taken >= cores else 0.0)
            points[bool(shape.prefill_tokens)].append((model.predict(shape), seconds - extra))
    prefill_s, prefill_factor = fit_line(points[True])
    decode_s, decode_factor = fit_line(points[False])
    return ServedSteps(prefill_s, prefill_factor, decode_s, decode_factor)


def _busy_at(starts: list[float], ends: list[float], t: float) -> bool:
    """Whether a worker whose steps span `starts[i]..ends[i]` was in a step at `t`."""
    i = bisect.bisect_right(starts, t) - 1
    return i >= 0 and ends[i] > t


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(extra_s, factor) of measured = extra_s + factor * predicted over (predicted,
    measured) `points`: the line through the medians of the lower and the upper half by
    prediction, robust to a step the client preempted. Where the halves' predictions lie
    less than MIN_SPREAD apart, or the line would need a negative part, the factor alone:
    the median ratio. (0, 1) with fewer than MIN_STEPS points, or where the median step
    cleared of the simulator's own additions is not above 0 (they cover it already: a tiny
    model's sub-millisecond decode steps less a millisecond of token CPU)."""
    if len(points) < MIN_STEPS:
        return 0.0, 1.0
    ratio = statistics.median(m / p for p, m in points)
    if ratio <= 0:
        return 0.0, 1.0
    ordered = sorted(points)
    half = len(ordered) // 2
    lower, upper = ordered[:half], ordered[len(ordered) - half :]
    p0, m0 = statistics.median(p for p, _ in lower), statistics.median(m for _, m in lower)
    p1, m1 = statistics.median(p for p, _ in upper), statistics.median(m for _, m in upper)
    if p1 < MIN_SPREAD * p0:
        return 0.0, ratio
    factor = (m1 - m0) / (p1 - p0)
    extra_s = m0 - factor * p0
    if factor <= 0 or extra_s < 0:
        return 0.0, ratio
    return extra_s, factor
