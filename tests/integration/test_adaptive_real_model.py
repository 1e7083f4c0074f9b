"""The real default model behind an adaptive deployment: greedy output equals a collocated
worker's whichever path each request took. Prompts of mixed length go out together, so decodes
run while prefills arrive, and the planner has an ITL target tight enough that the long ones
are prefilled remotely (the short ones, and the first, locally)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from pdserve.cluster.config import Pipeline, WorkerGroup
from pdserve.cluster.launcher import Cluster, free_port
from pdserve.planner.config import AdaptiveConfig

pytestmark = pytest.mark.integration

PROMPTS = [("Tell me about the history of Rome. " * n).strip() for n in (1, 30, 2, 60, 3, 45)]
POOL = tuple(sorted(os.sched_getaffinity(0)))[:2]


def serve(pipeline: Pipeline) -> tuple[list[str], set[str]]:
    with Cluster(pipeline, log_level="WARNING") as url:

        def complete(prompt: str) -> str:
            body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            r = requests.post(f"{url}/v1/completions", json=body, timeout=600)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            texts = list(pool.map(complete, PROMPTS))
        metrics = requests.get(f"{url}/metrics", timeout=10).text
    kinds = {
        line.split("{")[1].split(",")[0]
        for line in metrics.splitlines()
        if line.startswith("pdserve_adaptive_decisions_total{")
    }
    return texts, kinds


@pytest.mark.skipif(len(POOL) < 2, reason="an adaptive deployment of 2 workers needs 2 cores")
def test_adaptive_gives_collocated_greedy_output_local_and_remote():
    one = WorkerGroup(cpus=POOL, threads=len(POOL))
    collocated, _ = serve(Pipeline(collocated=one, port=free_port()))
    adaptive = AdaptiveConfig(enabled=True, slo_itl_ms=5.0, fallback_prompt_tokens=64)
    pipeline = Pipeline(adaptive=adaptive, workers=WorkerGroup(cpus=POOL), port=free_port())
    texts, kinds = serve(pipeline)
    assert kinds == {'kind="local"', 'kind="remote"'}  # both paths taken
    assert texts == collocated
