"""The real default model with every sampling feature on (penalties, logit_bias, min_tokens,
a seed, logprobs, n, echo with the prompt scored): an adaptive deployment, which prefills
some requests on its decode worker and hands others over from its prefill worker, answers
exactly as a collocated worker does, greedy and seeded."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from pdserve.cluster.config import Pipeline, WorkerGroup
from pdserve.cluster.launcher import Cluster, free_port
from pdserve.planner.config import AdaptiveConfig
from tests.integration.test_adaptive_real_model import POOL, PROMPTS

pytestmark = pytest.mark.integration

FEATURES = {
    "max_tokens": 16,
    "repetition_penalty": 1.2,
    "presence_penalty": 0.4,
    "frequency_penalty": 0.6,
    "logit_bias": {"28": -100, "30": 2.0},
    "min_tokens": 8,
    "logprobs": 2,
}


@pytest.mark.skipif(len(POOL) < 2, reason="an adaptive deployment of 2 workers needs 2 cores")
@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0}, {"temperature": 0.9, "seed": 5, "n": 2}, {"temperature": 0, "echo": True}],
    ids=["greedy", "seeded-n2", "echo"],
)
def test_adaptive_equals_collocated_with_sampling_features(sampling):
    bodies = [{"prompt": p, **FEATURES, **sampling} for p in PROMPTS]
    collocated, _ = serve_bodies(
        Pipeline(collocated=WorkerGroup(cpus=POOL, threads=len(POOL)), port=free_port()), bodies
    )
    adaptive = AdaptiveConfig(enabled=True, slo_itl_ms=5.0, fallback_prompt_tokens=64)
    answers, kinds = serve_bodies(
        Pipeline(adaptive=adaptive, workers=WorkerGroup(cpus=POOL), port=free_port()), bodies
    )
    assert kinds == {'kind="local"', 'kind="remote"'}  # both paths taken
    for got, want in zip(answers, collocated):
        assert [(c["text"], c["logprobs"]["tokens"]) for c in got] == [
            (c["text"], c["logprobs"]["tokens"]) for c in want
        ]
        for mine, theirs in zip(got, want):
            lp, ref = mine["logprobs"]["token_logprobs"], theirs["logprobs"]["token_logprobs"]
            assert lp == pytest.approx(ref, abs=1e-3)


def serve_bodies(pipeline: Pipeline, bodies: list[dict]) -> tuple[list[list[dict]], set[str]]:
    """Each body's choices, all sent at once, and the adaptive decisions' kinds taken."""
    with Cluster(pipeline, log_level="WARNING") as url:

        def complete(body: dict) -> list[dict]:
            r = requests.post(f"{url}/v1/completions", json=body, timeout=600)
            assert r.status_code == 200, r.text
            return r.json()["choices"]

        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(complete, bodies))
        metrics = requests.get(f"{url}/metrics", timeout=10).text
    kinds = {
        line.split("{")[1].split(",")[0]
        for line in metrics.splitlines()
        if line.startswith("pdserve_adaptive_decisions_total{")
    }
    return answers, kinds
