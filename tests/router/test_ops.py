"""Operational routes and limits: health, metrics, API key, backpressure, heartbeats."""

from __future__ import annotations

from pathlib import Path

import requests

from tests.router.harness import Cluster


def test_health_is_503_until_every_role_is_ready(tokenizer_dir: Path, script: list[int]) -> None:
    roles = {"p0": "prefill", "d0": "decode"}
    with Cluster(tokenizer_dir, script, roles, start_workers=False) as c:
        r = requests.get(f"{c.url}/health")
        assert r.status_code == 503
        assert r.json()["missing_roles"] == ["decode", "prefill"]
        body = {"prompt": "hi", "max_tokens": 2}
        r = requests.post(f"{c.url}/v1/completions", json=body)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        c.start_workers()
        c.wait_until(lambda: requests.get(f"{c.url}/health").status_code == 200)
        assert requests.get(f"{c.url}/health").json()["workers"]["d0"]["healthy"] is True


def test_silent_worker_becomes_unhealthy(tokenizer_dir: Path, script: list[int]) -> None:
    with Cluster(tokenizer_dir, script, {"c0": "collocated"}, heartbeat_timeout_s=0.3) as c:
        c.workers["c0"].heartbeat = False
        c.wait_until(lambda: requests.get(f"{c.url}/health").status_code == 503)
        r = requests.post(f"{c.url}/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503
        assert c.kinds("c0") == []  # never routed to
        c.workers["c0"].heartbeat = True
        c.wait_until(lambda: requests.get(f"{c.url}/health").status_code == 200)


def test_metrics_expose_named_series(tokenizer_dir: Path, script: list[int]) -> None:
    with Cluster(tokenizer_dir, script, {"c0": "collocated"}) as c:
        c.wait_until(lambda: c.app_state.plane.workers["c0"].stats is not None)
        assert requests.post(f"{c.url}/v1/completions", json={"prompt": "hi"}).ok
        r = requests.get(f"{c.url}/metrics")
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.text
        for line in (
            'pdserve_queue_length{worker="c0"} 0',
            'pdserve_kv_blocks_free{worker="c0"} 60',
            'pdserve_kv_blocks_total{worker="c0"} 64',
            'pdserve_kv_transfer_bytes_total{direction="sent",worker="c0"} 7',
            'pdserve_kv_transfer_skipped_blocks_total{worker="c0"} 3',
            'pdserve_requests_total{status="success"} 1',
            "# TYPE pdserve_time_to_first_token_seconds histogram",
            'pdserve_time_to_first_token_seconds_bucket{le="+Inf"} 1',
            "pdserve_time_per_output_token_seconds_count 1",
            "pdserve_e2e_request_latency_seconds_count 1",
        ):
            assert line in text, line
        assert 'pdserve_running_requests{worker="c0"}' in text


def test_api_key_guards_v1_only(tokenizer_dir: Path, script: list[int]) -> None:
    with Cluster(tokenizer_dir, script, {"c0": "collocated"}, api_key="sekret") as c:
        body = {"prompt": "hi", "max_tokens": 1}
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = requests.post(f"{c.url}/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert requests.get(f"{c.url}/v1/models").status_code == 401
        ok = requests.post(
            f"{c.url}/v1/completions", json=body, headers={"Authorization": "Bearer sekret"}
        )
        assert ok.status_code == 200
        assert requests.get(f"{c.url}/health").status_code == 200
        assert requests.get(f"{c.url}/metrics").status_code == 200


def test_over_max_pending_gets_429(tokenizer_dir: Path, script: list[int]) -> None:
    behaviour = {"c0": {"step_s": 0.1}}
    with Cluster(tokenizer_dir, script, {"c0": "collocated"}, behaviour, max_pending=1) as c:
        body = {"prompt": "hi", "max_tokens": 5, "stream": True}
        held = requests.post(f"{c.url}/v1/completions", json=body, stream=True)
        lines = held.iter_lines(chunk_size=1)  # keep it: dropping it closes the connection
        next(lines)
        r = requests.post(f"{c.url}/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
        list(lines)  # finish the first request: capacity comes back
        assert requests.post(f"{c.url}/v1/completions", json={"prompt": "hi"}).ok


def test_forged_frames_are_dropped(tokenizer_dir: Path, script: list[int]) -> None:
    import zmq

    from pdserve import messages

    with Cluster(tokenizer_dir, script, {"c0": "collocated"}) as c:
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(c.router_address)
        forged = messages.Ready("c0", "decode", "evil", 1, 16, 8)
        push.send(messages.Signer(b"wrong secret").encode(forged))
        push.send(b"garbage")
        push.close(linger=1000)
        r = requests.post(f"{c.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
        assert c.app_state.plane.workers["c0"].role == "collocated"


def test_replayed_frames_are_dropped(tokenizer_dir: Path, script: list[int]) -> None:
    """A worker's frame sent again (recorded on the wire) is not acted on: here an old
    KVEvents that would put back a prefix the worker has since evicted."""
    import zmq

    from pdserve import messages
    from tests.router.harness import SECRET

    with Cluster(tokenizer_dir, script, {"c0": "collocated"}) as c:
        assert c.app_state.plane._pull.getsockopt(zmq.MAXMSGSIZE) == 16 * 2**20
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(c.router_address)
        signer = messages.Signer(SECRET)
        stored = signer.encode(messages.KVEvents("c0", [123], []))
        push.send(stored)
        push.send(signer.encode(messages.KVEvents("c0", [], [123])))
        push.send(stored)  # the replay
        push.send(signer.encode(messages.KVEvents("c0", [456], [])))
        push.close(linger=1000)
        hashes = c.app_state.plane.workers["c0"].cached_hashes
        c.wait_until(lambda: 456 in hashes)
        assert 123 not in hashes
