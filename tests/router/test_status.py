"""/v1/status and its history, the dashboard's files, request ids and opt-in timing on fake
workers, and `pdserve status`."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from pdserve.router.metrics import Window
from pdserve.router.status import History, percentiles
from tests.router.harness import Cluster


def row(worker: str, sent: int, hits: int, lookups: int, free: int = 60) -> dict:
    return {
        "worker": worker,
        "kv_bytes_sent": sent,
        "num_waiting": 1,
        "num_running": 2,
        "num_free_blocks": free,
        "num_total_blocks": 64,
        "threads": 2,
        "kv_tiers": {"L1": {"hits": hits, "lookups": lookups}},
    }


def window(ttfts: list[float], parts: dict[str, float] | None = None) -> Window:
    w = Window()
    for ttft in ttfts:
        w.add(ttft, None, [], parts, num_output_tokens=10)
    return w.take()


def test_history_points_hold_interval_differences_and_stay_bounded():
    h = History(interval_s=1.0, num_points=3)
    h.add(100.0, window([]), [row("p0", 1000, 5, 10)], num_pending=0)  # baseline
    h.add(101.0, window([0.1, 0.2, 0.3], {"queued": 0.02}), [row("p0", 3000, 9, 20, 50)], 2)
    point = h.points[-1]
    assert point["transfer_bytes_per_s"] == 2000
    assert point["cache"] == {"L1": {"hits": 4, "lookups": 10}}
    assert point["workers"]["p0"] == {
        "num_waiting": 1,
        "num_running": 2,
        "kv_blocks_used": 14,
        "threads": 2,
    }
    assert point["ttft_s"] == [0.2, 0.3, 0.3] and point["tpot_s"] is None
    assert point["requests_per_s"] == 3 and point["output_tokens_per_s"] == 30
    assert point["ttft_parts_s"] == {"queued": pytest.approx(0.02)}
    assert point["num_pending"] == 2
    h.add(103.0, window([]), [row("p0", 500, 1, 2)], 0)  # restarted: counts from zero
    assert h.points[-1]["transfer_bytes_per_s"] == 250  # over the 2 s since the last point
    assert h.points[-1]["cache"]["L1"] == {"hits": 1, "lookups": 2}
    h.add(104.0, window([]), [row("p0", 500, 1, 2)], 0)
    assert len(h.points) == 3 and h.points[0]["t"] == 101.0
    assert [p["t"] for p in h.since(101.0)] == [103.0, 104.0]
    recent = h.recent()
    assert recent["requests_per_s"] == 3 / 5  # over the windows kept: 1 + 1 + 2 + 1 s
    assert recent["ttft_s"] == [0.2, 0.3, 0.3]


def test_window_keeps_a_bounded_sample():
    w = Window(max_samples=100)
    for i in range(10_000):
        w.add(i / 10_000, None, [], None, 1)
    taken = w.take()
    assert taken.num_finished == 10_000 and len(taken.samples["ttft_s"]) == 100
    assert 0.3 < percentiles(taken.samples["ttft_s"])[0] < 0.7  # a uniform sample's median
    assert w.num_finished == 0 and w.samples == {}


def test_status_route_and_dashboard_files(tokenizer_dir: Path, script: list[int]) -> None:
    roles = {"p0": "prefill", "d0": "decode"}
    with Cluster(tokenizer_dir, script, roles, api_key="k") as c:
        c.wait_until(lambda: all(w.stats for w in c.app_state.plane.workers.values()))
        auth = {"Authorization": "Bearer k"}
        for _ in range(3):
            assert requests.post(f"{c.url}/v1/completions", json={"prompt": "hi"}, headers=auth).ok
        c.wait_until(lambda: any(p["num_finished"] for p in c.app[_history()].points), 3)
        status = requests.get(f"{c.url}/v1/status").json()  # public, like /metrics
        assert [(w["worker"], w["role"], w["healthy"]) for w in status["workers"]] == [
            ("p0", "prefill", 1),
            ("d0", "decode", 1),
        ]
        assert status["workers"][0]["kv_blocks_used"] == 4
        memory = ("rss_bytes", "pss_bytes", "weight_bytes", "kv_pool_bytes")  # from Stats
        assert all(isinstance(status["workers"][0][key], int) for key in memory)
        assert status["requests"] == {"success": 3} and status["health"]["ok"]
        assert sum(p["num_finished"] for p in status["history"]) == 3
        assert "planner" not in status  # nothing to show until the planner exists
        last = status["history"][-1]["t"]
        assert requests.get(f"{c.url}/v1/status?since={last}").json()["history"] == []
        assert requests.get(f"{c.url}/v1/status?since=x").status_code == 400
        page = requests.get(f"{c.url}/dashboard")  # the page's files need no key
        assert page.ok and page.headers["Content-Type"].startswith("text/html")
        for name in ("dashboard.js", "uPlot.iife.min.js", "uPlot.min.css"):
            assert requests.get(f"{c.url}/dashboard/{name}").ok, name
        assert requests.get(f"{c.url}/dashboard/nope.js").status_code == 404
        assert requests.get(f"{c.url}/v1/models").status_code == 401


def _history():
    from pdserve.router.status import HISTORY

    return HISTORY


def test_status_needs_the_key_when_ops_paths_are_protected(tokenizer_dir, script) -> None:
    config = {"api_key": "k", "protect_health_metrics": True}
    with Cluster(tokenizer_dir, script, {"c0": "collocated"}, **config) as c:
        assert requests.get(f"{c.url}/v1/status").status_code == 401
        auth = {"Authorization": "Bearer k"}
        assert requests.get(f"{c.url}/v1/status", headers=auth).ok
        assert requests.get(f"{c.url}/dashboard/dashboard.js").ok


@pytest.mark.parametrize("stream", [False, True])
def test_request_id_and_opt_in_timing(tokenizer_dir: Path, script: list[int], stream) -> None:
    with Cluster(tokenizer_dir, script, {"p0": "prefill", "d0": "decode"}) as c:
        body = {"prompt": "hi", "max_tokens": 4, "stream": stream}
        plain = requests.post(f"{c.url}/v1/completions", json=body)
        timed = requests.post(
            f"{c.url}/v1/completions", json=body, headers={"X-PDServe-Timing": "1"}
        )
        for r in (plain, timed):
            request_id = r.headers["X-Request-Id"]
            assert request_id.startswith("cmpl-") and request_id in r.text  # the body's id
            # Every attempt's worker-side id starts with it: one id to grep for.
            sent = [rid for wid, kind, rid in c.events if rid.startswith(request_id)]
            assert {kind for wid, kind, rid in c.events if rid in sent} >= {"Reserve", "Prefill"}
        assert "pdserve_timing" not in plain.text
        report = _last_json(timed.text) if stream else timed.json()
        timing = report["pdserve_timing"]
        assert timing["request_id"] == timed.headers["X-Request-Id"]
        assert 0 < timing["ttft_s"] < timing["first_decode_token_s"]


def _last_json(sse: str) -> dict:
    import json

    events = [line[6:] for line in sse.splitlines() if line.startswith("data: {")]
    return json.loads(events[-1])


def pdserve_status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "status", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_pdserve_status_shows_the_cluster(tokenizer_dir: Path, script: list[int]) -> None:
    with Cluster(tokenizer_dir, script, {"p0": "prefill", "d0": "decode"}) as c:
        assert requests.post(f"{c.url}/v1/completions", json={"prompt": "hi"}).ok
        time.sleep(1.2)  # one status interval: the request is in the recent window
        done = pdserve_status(c.url)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "healthy" in lines[0] and c.url in lines[0]
    assert any(line.split()[:2] == ["p0", "prefill"] for line in lines)
    assert any(line.split()[:2] == ["d0", "decode"] for line in lines)
    assert "TTFT  p50" in done.stdout and "requests since start: success 1" in done.stdout


def test_pdserve_status_of_a_cluster_that_is_down(tokenizer_dir: Path, script: list[int]) -> None:
    from pdserve.cluster.launcher import free_port

    down = pdserve_status(f"http://127.0.0.1:{free_port()}")
    assert down.returncode == 1 and down.stdout == ""
    assert len(down.stderr.splitlines()) == 1 and "cannot reach a router" in down.stderr
    with Cluster(tokenizer_dir, script, {"c0": "collocated"}) as c:
        wrong = pdserve_status(f"{c.url}/v1")  # answers, but not as a router's root
    assert wrong.returncode == 1 and "HTTP 404" in wrong.stderr
    assert len(wrong.stderr.splitlines()) == 1
    bad = pdserve_status("localhost:8000")
    assert bad.returncode == 1 and len(bad.stderr.splitlines()) == 1


def test_worker_memory_gauges():
    from prometheus_client.parser import text_string_to_metric_families

    from pdserve.router.metrics import RouterMetrics
    from tests.router.test_metrics import ROW

    memory = {
        "rss_bytes": 3 << 30,
        "pss_bytes": 2 << 30,
        "weight_bytes": 1 << 30,
        "kv_pool_bytes": 1 << 29,
    }
    text = RouterMetrics().render([{**ROW, "role": "decode", **memory}], 0)
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    for key, value in memory.items():
        assert values[f"pdserve_worker_{key}"] == value
