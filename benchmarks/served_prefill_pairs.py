"""A served worker's prefill step against the engine's own, each lone prompt timed in a pair.

    .venv/bin/python benchmarks/served_prefill_pairs.py [--deployment 1p1d|1p1d-full|collocated]
        [--rounds 6] [--prompts 32,256]

Each round sends each length's lone prompt to the deployment, just after timing the same
length on a one-thread engine in this process, on the first core
(`measure.lone_prefill_timer`, what `pdserve profile` prices `send_step_s` with). The
prompt's worker sits on that core too: the prefill worker of `1p1d` (`1p1d-full`: whole-
prompt sends instead of layer-wise ones), or a one-thread collocated worker. Its steps come
from `PDSERVE_STEP_TRACE`. Prints per length the medians of the engine alone, the served
step and the router's prefill part, and the median of served less alone over the pairs.
The first round warms up and is not counted. Needs a quiet machine with two cores or more.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

from pdserve import envs
from pdserve.bench.tokens import TokenSource
from pdserve.cluster.config import Pipeline, Role
from pdserve.cluster.deployments import pipeline_for
from pdserve.cluster.launcher import Cluster, free_port
from pdserve.perf.measure import ProfileConfig, lone_prefill_timer
from pdserve.perf.served import first_token
from pdserve.transfer import TensorStore
from pdserve.workers.step_report import read_trace

KV_CACHE_BYTES = 1 << 30


def pipeline(name: str, model: str) -> Pipeline:
    if name == "collocated":
        role = Role(cpus=[(0,)], threads=1, kv_cache_bytes=KV_CACHE_BYTES)
        return Pipeline(model=model, collocated=role, port=free_port())
    disaggregated = pipeline_for("1p1d", model, KV_CACHE_BYTES)
    if name == "1p1d-full":
        return replace(disaggregated, kv_transfer=TensorStore(backend="auto", mode="full"))
    return disaggregated


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deployment", choices=("1p1d", "1p1d-full", "collocated"),
                        default="1p1d")  # fmt: skip
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompts", default="32,256", help="prompt lengths, comma-separated")
    args = parser.parse_args()
    lengths = [int(n) for n in args.prompts.split(",")]
    source, rng = TokenSource.load(args.model), np.random.default_rng(0)
    alone: dict[int, list[float]] = {n: [] for n in lengths}
    parts: dict[int, list[float]] = {n: [] for n in lengths}
    cfg = ProfileConfig(model=args.model, kv_cache_bytes=KV_CACHE_BYTES)
    with tempfile.TemporaryDirectory() as tmp, envs.step_trace(Path(tmp)):
        with lone_prefill_timer(cfg) as time_alone:
            with Cluster(pipeline(args.deployment, args.model), log_level="WARNING") as url:
                for i in range(args.rounds):
                    for n in lengths:
                        alone_s = time_alone(n)
                        _, timing = first_token(url, args.model, source.random_ids(rng, n), 2)
                        if i:
                            alone[n].append(alone_s)
                            parts[n].append(timing["prefill"])
        served: dict[int, list[float]] = {n: [] for n in lengths}
        for path in Path(tmp).glob("*.steps.jsonl"):
            if not path.name.startswith("decode"):
                for shape, _, _, seconds in read_trace(path):
                    if shape.prefill_tokens in served:
                        served[shape.prefill_tokens].append(seconds)
    print(f"{args.deployment}: ms, medians over {args.rounds - 1} pairs")
    for n in lengths:
        steps = served[n][-len(alone[n]) :]  # the counted rounds' steps, in send order
        pairs = [s - a for a, s in zip(alone[n], steps, strict=True)]
        print(f"{n:>6} tokens: alone {statistics.median(alone[n]) * 1e3:8.1f}  served step "
              f"{statistics.median(steps) * 1e3:8.1f}  router prefill part "
              f"{statistics.median(parts[n]) * 1e3:8.1f}  served - alone "
              f"{statistics.median(pairs) * 1e3:+8.1f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
