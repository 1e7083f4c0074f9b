"""Router-side deadlines over fake workers whose engine loop freezes while their heartbeat
goes on: the request is re-driven on another worker (or fails cleanly) within the bound, and
other requests keep flowing."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import requests

from tests.router.conftest import OUTPUT_TEXT
from tests.router.harness import Cluster
from tests.router.test_recovery import stream_text

C2 = {"c0": "collocated", "c1": "collocated"}


def test_a_worker_silent_between_tokens_is_left_mid_stream(
    tokenizer_dir: Path, script: list[int]
) -> None:
    behaviour = {"c0": {"freeze_after_tokens": 3}}
    config = dict(policy="round_robin", token_timeout_s=1.0, first_token_timeout_s=1.0)
    with Cluster(tokenizer_dir, script, C2, behaviour, **config) as c:
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            texts = list(pool.map(lambda _: stream_text(c)[0], range(2)))
        assert texts == [OUTPUT_TEXT[:12]] * 2  # no token lost or repeated
        assert time.monotonic() - start < 1.0 + 3.0
        c.wait_until(lambda: "Abort" in c.kinds("c0"))  # the Abort may land after the reply
        assert c.kinds("c1").count("Generate") == 2
        assert c.app_state.plane.is_healthy("c0")  # it heartbeats: only the deadline caught it
        for _ in range(2):  # later requests flow, one of them via c0 and its deadline
            assert stream_text(c)[0] == OUTPUT_TEXT[:12]


def test_a_prefill_worker_silent_before_its_first_token(
    tokenizer_dir: Path, script: list[int]
) -> None:
    roles = {"p0": "prefill", "p1": "prefill", "d0": "decode"}
    behaviour = {"p0": {"freeze_after_tokens": 0}}
    config = dict(policy="round_robin", first_token_timeout_s=1.0)
    with Cluster(tokenizer_dir, script, roles, behaviour, **config) as c:
        for _ in range(2):  # round robin sends one of them to p0
            start = time.monotonic()
            assert stream_text(c)[0] == OUTPUT_TEXT[:12]
            assert time.monotonic() - start < 1.0 + 3.0
        c.wait_until(lambda: "Abort" in c.kinds("p0"))
        assert c.kinds("p1").count("Prefill") == 2


def test_every_worker_silent_fails_cleanly_within_the_bound(
    tokenizer_dir: Path, script: list[int]
) -> None:
    behaviour = {"c0": {"freeze_after_tokens": 0}}
    config = dict(first_token_timeout_s=1.0)
    with Cluster(tokenizer_dir, script, {"c0": "collocated"}, behaviour, **config) as c:
        start = time.monotonic()
        r = requests.post(f"{c.url}/v1/completions", json={"prompt": "Hi"}, timeout=20)
        assert r.status_code == 503
        assert "missed a deadline" in r.json()["error"]["message"]
        assert time.monotonic() - start < 1.0 + 3.0
        c.wait_until(lambda: "Abort" in c.kinds("c0"))


def test_a_frozen_decode_worker_mid_stream_hands_the_request_to_the_prefill_worker(
    tokenizer_dir: Path, script: list[int]
) -> None:
    # The one decode worker freezes after 3 tokens (its heartbeat goes on). No decode worker
    # is left for this request, so the prefill worker, the last resort, finishes it: the
    # stream goes on, no token lost or repeated (was: a 503).
    roles = {"p0": "prefill", "d0": "decode"}
    behaviour = {"d0": {"freeze_after_tokens": 3}}
    config = dict(token_timeout_s=1.0, first_token_timeout_s=1.0)
    with Cluster(tokenizer_dir, script, roles, behaviour, **config) as c:
        assert stream_text(c)[0] == OUTPUT_TEXT[:12]
        assert c.kinds("p0").count("Generate") == 1
        c.wait_until(lambda: "Abort" in c.kinds("d0"))


def test_a_long_engine_step_is_not_a_silent_worker(tokenizer_dir: Path, script: list[int]) -> None:
    # One step of 1.5 s (a large prefill chunk on a slow CPU) past a 0.5 s token timeout: the
    # heartbeat says the worker is inside that step, so the stream waits for it (was: the
    # worker counted as frozen, the request re-driven and, with no other worker, failed).
    behaviour = {"c0": {"long_step_after_tokens": 3, "long_step_s": 1.5}}
    config = dict(token_timeout_s=0.5, first_token_timeout_s=0.5)
    with Cluster(tokenizer_dir, script, {"c0": "collocated"}, behaviour, **config) as c:
        start = time.monotonic()
        assert stream_text(c)[0] == OUTPUT_TEXT[:12]
        assert time.monotonic() - start >= 1.5
        assert "Abort" not in c.kinds("c0")


def test_a_step_past_the_step_timeout_is_a_frozen_worker(
    tokenizer_dir: Path, script: list[int]
) -> None:
    # A kernel that never returns: the heartbeat goes on, its step's running time passes
    # step_timeout_s, and the worker counts as frozen for the request: with no other worker,
    # a clean 503 after the step timeout (not the shorter token timeout).
    behaviour = {"c0": {"long_step_after_tokens": 0, "long_step_s": float("inf")}}
    config = dict(token_timeout_s=0.5, first_token_timeout_s=0.5, step_timeout_s=1.5)
    with Cluster(tokenizer_dir, script, {"c0": "collocated"}, behaviour, **config) as c:
        start = time.monotonic()
        r = requests.post(f"{c.url}/v1/completions", json={"prompt": "Hi"}, timeout=20)
        assert r.status_code == 503
        assert "missed a deadline" in r.json()["error"]["message"]
        assert 1.5 <= time.monotonic() - start < 1.5 + 3.0
        c.wait_until(lambda: "Abort" in c.kinds("c0"))
