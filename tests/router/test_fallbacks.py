"""Every fallback a request takes shows on /metrics (pdserve/router/fallbacks.py): re-drives
by worker and reason, requests served whole by one worker in a disaggregated deployment,
retried refusals. Fake workers; tests/faults/ checks the same counters on real ones."""

from __future__ import annotations

import re
from pathlib import Path

import requests

from tests.router.conftest import OUTPUT_TEXT
from tests.router.harness import Cluster
from tests.router.test_recovery import P2D2, stream_text

PD = {"p0": "prefill", "d0": "decode"}


def counters(c: Cluster, name: str) -> dict[tuple[str, ...], float]:
    """`name`'s samples on /metrics, by (worker, reason) or (worker,)."""
    text = requests.get(f"{c.url}/metrics", timeout=5).text
    found = {}
    for labels, value in re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.MULTILINE):
        values = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        found[tuple(values[k] for k in ("worker", "reason") if k in values)] = float(value)
    return found


def complete(c: Cluster, max_tokens: int = 5) -> str:
    r = requests.post(f"{c.url}/v1/completions", json={"prompt": "Hi", "max_tokens": max_tokens})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_a_clean_request_counts_no_fallback(tokenizer_dir: Path, script: list[int]) -> None:
    with Cluster(tokenizer_dir, script, PD) as c:
        assert complete(c) == OUTPUT_TEXT[:5]
        for name in (
            "pdserve_request_redrives_total",
            "pdserve_local_prefill_fallbacks_total",
            "pdserve_rejections_retried_total",
        ):
            assert counters(c, name) == {}, name


def test_a_failed_prefill_is_a_counted_redrive(tokenizer_dir: Path, script: list[int]) -> None:
    behaviour = {"p0": {"fail_with": "transfer broke", "fail_times": 1}}
    with Cluster(tokenizer_dir, script, PD, behaviour) as c:
        assert complete(c) == OUTPUT_TEXT[:5]
        assert counters(c, "pdserve_request_redrives_total") == {("p0", "failed"): 1}
        assert counters(c, "pdserve_local_prefill_fallbacks_total") == {}  # P served it again


def test_no_prefill_worker_left_is_a_counted_local_prefill(
    tokenizer_dir: Path, script: list[int]
) -> None:
    with Cluster(tokenizer_dir, script, PD) as c:
        c.kill("p0")
        c.wait_until(lambda: "prefill" not in c.app_state.plane.healthy_roles())
        assert complete(c) == OUTPUT_TEXT[:5]
        assert counters(c, "pdserve_local_prefill_fallbacks_total") == {("d0", "no_prefill"): 1}


def test_no_decode_worker_left_is_counted_on_the_prefill_worker(
    tokenizer_dir: Path, script: list[int]
) -> None:
    with Cluster(tokenizer_dir, script, PD) as c:
        c.kill("d0")
        c.wait_until(lambda: "decode" not in c.app_state.plane.healthy_roles())
        assert complete(c) == OUTPUT_TEXT[:5]
        assert counters(c, "pdserve_local_prefill_fallbacks_total") == {("p0", "no_decode"): 1}


def test_a_decode_worker_dying_mid_stream_counts_the_redrive_and_the_resume(
    tokenizer_dir: Path, script: list[int]
) -> None:
    behaviour = {"d0": {"die_after_tokens": 4, "step_s": 0.02}}
    with Cluster(tokenizer_dir, script, P2D2, behaviour, policy="round_robin") as c:
        text, _ = stream_text(c)
        assert text == OUTPUT_TEXT[:12]
        assert counters(c, "pdserve_request_redrives_total") == {("d0", "lost"): 1}
        assert counters(c, "pdserve_local_prefill_fallbacks_total") == {("d1", "resumed"): 1}


def test_a_silent_worker_is_a_redrive_of_its_own_reason(
    tokenizer_dir: Path, script: list[int]
) -> None:
    behaviour = {"p0": {"prefill_s": 30.0}}
    with Cluster(
        tokenizer_dir, script, P2D2, behaviour, policy="round_robin", first_token_timeout_s=0.5
    ) as c:
        assert complete(c) == OUTPUT_TEXT[:5]
        assert counters(c, "pdserve_request_redrives_total") == {("p0", "silent"): 1}


def test_retried_refusals_are_counted_per_worker(tokenizer_dir: Path, script: list[int]) -> None:
    with Cluster(tokenizer_dir, script, PD, {"d0": {"reject_reserves": 2}}) as c:
        assert complete(c, 2) == OUTPUT_TEXT[:2]
        assert counters(c, "pdserve_rejections_retried_total") == {("d0",): 2}
