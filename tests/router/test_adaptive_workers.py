"""An adaptive deployment of real workers (tiny model, two processes on one core pool): the
planner prefills some requests on the decode worker and some on the prefill worker while it
moves cores between them, and greedy output is the collocated worker's, token for token."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from pdserve.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from pdserve.envs import CLUSTER_SECRET as SECRET_ENV
from pdserve.planner.config import AdaptiveConfig
from pdserve.workers.spec import WorkerSpec
from tests.router.harness import SECRET, Cluster

KV_BYTES = 256 * 16 * 512  # 256 blocks of 16 tokens
POOL = tuple(sorted(os.sched_getaffinity(0)))[:2]
# The fallback rule decides (no model reaches a million steps; an ITL target is set, so it
# applies): over 32 uncached tokens on a decode worker with running decodes is remote, the
# rest local.
ADAPTIVE = AdaptiveConfig(
    enabled=True,
    interval_s=0.1,
    core_dwell_s=0.2,
    min_samples=10**6,
    fallback_prompt_tokens=32,
    slo_itl_ms=1000.0,
)


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(40, 120) for _ in range(n)] for n in (7, 150, 20, 90, 12, 200, 60, 9)]


def complete(url: str, prompt: list[int]) -> str:
    body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    r = requests.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def spawn(c: Cluster, model: Path, adaptive: bool) -> list[subprocess.Popen]:
    engine = EngineConfig(
        model=str(model),
        cache=CacheConfig(kv_cache_bytes=KV_BYTES),
        scheduler=SchedulerConfig(long_prefill_token_threshold=32),  # chunked prefills
        device=DeviceConfig(threads=len(POOL)),
    )
    env = {**os.environ, SECRET_ENV: SECRET.hex()}
    procs = []
    for w in c.workers.values():
        spec = WorkerSpec(
            w.worker_id, w.role, engine, w.address, c.router_address, cpus=POOL, adaptive=adaptive
        )
        args = [sys.executable, "-m", "pdserve.workers.main", "--spec", spec.to_json()]
        procs.append(subprocess.Popen(args, env=env))
    return procs


def serve(model: Path, roles: dict[str, str], run, **config):
    with Cluster(model, [], roles, start_workers=False, **config) as c:
        procs = spawn(c, model, "adaptive" in config)
        try:
            plane = c.app_state.plane
            c.wait_until(lambda: all(plane.is_healthy(w) for w in roles), timeout=120)
            return run(c)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(10)


@pytest.mark.skipif(len(POOL) < 2, reason="needs two cores to move between the workers")
def test_adaptive_greedy_output_is_collocated_whichever_path(tiny_served_model):
    expected = serve(
        tiny_served_model, {"c0": "collocated"}, lambda c: [complete(c.url, p) for p in prompts()]
    )

    def run(c: Cluster) -> tuple[list[str], dict[str, float], dict]:
        with ThreadPoolExecutor(4) as pool:  # concurrent: later prompts meet running decodes
            outputs = list(pool.map(lambda p: complete(c.url, p), prompts() * 2))
        metrics = requests.get(f"{c.url}/metrics", timeout=10).text
        counts = {
            line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("pdserve_adaptive_decisions_total{")
        }
        return outputs, counts, requests.get(f"{c.url}/v1/status", timeout=10).json()["planner"]

    roles = {"p0": "prefill", "d1": "decode"}
    outputs, counts, planner = serve(tiny_served_model, roles, run, cpus=POOL, adaptive=ADAPTIVE)
    assert outputs == expected * 2
    kinds = {key.split(",")[0] for key in counts}
    assert kinds == {'kind="local"', 'kind="remote"'}, counts  # both paths taken
    assert planner["num_core_switches"] >= 2, planner["core_groups"]  # split and merged
