"""An all-core engine's prefill steps under each OpenMP wait policy, offline and served.

Offline: for each `--variant NAME:VAR=VALUE` a fresh process (libgomp reads the variables
once, when torch loads it) builds the engine on every core and times `Engine.step` for
one-prompt prefills of each `--lengths` (median of `--repeats`, after a warm-up). Served: a
collocated deployment (its worker sets its own policy, `envs.set_worker_thread_wait`), the
same prompt lengths sent one at a time, the router's `prefill` part of the TTFT breakdown
(the worker's step). `pdserve profile` times its steps under a worker's policy: this is the
table that shows why (BENCHMARKS.md §8, docs/simulator.md).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_wait_policy.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from bench_served import parse_variant

from pdserve import envs

OFFLINE = """
import json, os, statistics, sys, time
import numpy as np
from pdserve.config import CacheConfig, DeviceConfig, EngineConfig
from pdserve.engine.engine import Engine
from pdserve.sampling_params import SamplingParams
model, lengths, repeats = sys.argv[1], [int(n) for n in sys.argv[2].split(",")], int(sys.argv[3])
threads = len(os.sched_getaffinity(0))
engine = Engine(EngineConfig(model=model, cache=CacheConfig(enable_prefix_caching=False),
                             device=DeviceConfig(threads=threads)))
rng = np.random.default_rng(0)
params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
out = {}
for n in lengths:
    times = []
    for i in range(repeats + 1):
        engine.add_request(f"{n}-{i}", rng.integers(0, engine.model_config.vocab_size, n).tolist(),
                           params)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        if i:
            times.append(time.perf_counter() - start)
    out[n] = statistics.median(times)
print(json.dumps(out))
"""


def offline(model: str, lengths: str, repeats: int, env: dict[str, str]) -> dict[int, float]:
    clean = {k: v for k, v in os.environ.items() if k not in envs.thread_wait()}
    argv = [sys.executable, "-c", OFFLINE, model, lengths, str(repeats)]
    run = subprocess.run(argv, env={**clean, **env}, capture_output=True, text=True, check=True)
    return {int(k): v for k, v in json.loads(run.stdout.splitlines()[-1]).items()}


def served(model: str, lengths: list[int], repeats: int) -> dict[int, float]:
    import numpy as np

    from pdserve.bench.tokens import TokenSource
    from pdserve.cluster.deployments import pipeline_for
    from pdserve.cluster.launcher import Cluster
    from pdserve.perf.served import first_token

    source, rng, out = TokenSource.load(model), np.random.default_rng(1), {}
    with Cluster(pipeline_for("collocated", model), log_level="WARNING") as url:
        first_token(url, model, source.random_ids(rng, 64))  # warm-up
        for n in lengths:
            parts = [first_token(url, model, source.random_ids(rng, n))[1]["prefill"]
                     for _ in range(repeats)]  # fmt: skip
            out[n] = statistics.median(parts)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--lengths", default="64,128,512")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--variant", action="append", help="NAME:VAR=VALUE (default: libgomp's "
                   "default, a worker's 1,000 spins, 10,000 and 100,000)")  # fmt: skip
    args = p.parse_args()
    variants = args.variant or ["libgomp-default:GOMP_SPINCOUNT=300000",
                                "worker:GOMP_SPINCOUNT=1000", "spin10k:GOMP_SPINCOUNT=10000",
                                "spin100k:GOMP_SPINCOUNT=100000"]  # fmt: skip
    lengths = [int(n) for n in args.lengths.split(",")]
    columns = {}
    for name, env in map(parse_variant, variants):
        columns[f"offline {name}"] = offline(args.model, args.lengths, args.repeats, env)
    columns["served (worker)"] = served(args.model, lengths, args.repeats)
    print(f"cores {len(os.sched_getaffinity(0))}; median prefill step, ms")
    print(f"{'tokens':>6}  " + "  ".join(f"{c:>24}" for c in columns))
    for n in lengths:
        print(f"{n:>6}  " + "  ".join(f"{columns[c][n] * 1e3:>24.1f}" for c in columns))


if __name__ == "__main__":
    main()
