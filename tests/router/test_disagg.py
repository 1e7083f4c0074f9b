"""The disaggregated flow over a fake prefill + decode pair: order, TTFT, admission, aborts."""

from __future__ import annotations

import json
import time
from pathlib import Path

import requests

from tests.router.conftest import OUTPUT_TEXT
from tests.router.harness import EOS, Cluster

PD = {"p0": "prefill", "d0": "decode"}


def post(c: Cluster, body: dict, **kwargs) -> requests.Response:
    return requests.post(f"{c.url}/v1/completions", json=body, **kwargs)


def test_reserve_prefill_start_decode_in_order(tokenizer_dir: Path, script: list[int]) -> None:
    with Cluster(tokenizer_dir, script, PD) as c:
        r = post(c, {"prompt": "Hello", "max_tokens": 9})
        assert r.json()["choices"][0]["text"] == OUTPUT_TEXT[:9]
        assert r.json()["usage"]["completion_tokens"] == 9
        order = [(wid, kind) for wid, kind, _ in c.events]
        assert order == [("d0", "Reserve"), ("p0", "Prefill"), ("d0", "StartDecode")]
        assert len({rid for _, _, rid in c.events}) == 1  # P and D share the attempt's id
        assert c.app_state.plane.workers["p0"].sent_prefill_tokens == 0
        assert c.app_state.plane.workers["d0"].active_requests == 0


def test_decode_cached_prefix_is_skipped_by_prefill(tokenizer_dir: Path, script: list[int]) -> None:
    """The blocks D already holds (Reserved.num_cached_blocks) reach P as num_cached_blocks."""
    with Cluster(tokenizer_dir, script, PD, {"d0": {"num_cached_blocks": 1}}) as c:
        assert post(c, {"prompt": "Hello", "max_tokens": 3}).ok
        [prefill] = [m for m in c.workers["p0"].received if type(m).__name__ == "Prefill"]
        assert prefill.block_ids == [0, 1] and prefill.num_cached_blocks == 1


def test_decode_budget_reaches_prefill(tokenizer_dir: Path, script: list[int]) -> None:
    """Reserved's num_keep_blocks (and policy) go to P in Prefill (what P dropped and the
    kept blocks' scores then reach D with the KV, not through the router)."""
    with Cluster(tokenizer_dir, script, PD, {"d0": {"num_keep_blocks": 2}}) as c:
        assert post(c, {"prompt": "Hello", "max_tokens": 3}).ok
        [prefill] = [m for m in c.workers["p0"].received if type(m).__name__ == "Prefill"]
        assert (prefill.num_keep_blocks, prefill.sink_blocks, prefill.recent_blocks) == (
            2,
            1,
            1,
        )


def test_without_a_budget_nothing_is_dropped(tokenizer_dir: Path, script: list[int]) -> None:
    with Cluster(tokenizer_dir, script, PD) as c:
        assert post(c, {"prompt": "Hello", "max_tokens": 3}).ok
        [prefill] = [m for m in c.workers["p0"].received if type(m).__name__ == "Prefill"]
        assert prefill.num_keep_blocks is None


def test_first_token_streams_before_decode_tokens(tokenizer_dir: Path, script: list[int]) -> None:
    with Cluster(tokenizer_dir, script, PD, {"d0": {"step_s": 0.3}}) as c:
        r = post(c, {"prompt": "Hi", "max_tokens": 3, "stream": True}, stream=True)
        lines = r.iter_lines(chunk_size=1)
        first = json.loads(next(lines)[6:])
        assert first["choices"][0]["text"] == OUTPUT_TEXT[0]
        assert c.workers["p0"].num_tokens_sent == 1 and c.workers["d0"].num_tokens_sent == 0
        rest = [json.loads(line[6:]) for line in lines if line and line != b"data: [DONE]"]
        assert "".join(e["choices"][0]["text"] for e in rest) == OUTPUT_TEXT[1:3]
        assert c.workers["d0"].num_tokens_sent == 2


def test_single_token_request_aborts_decode(tokenizer_dir: Path, script: list[int]) -> None:
    with Cluster(tokenizer_dir, script, PD) as c:
        body = post(c, {"prompt": "Hi", "max_tokens": 1}).json()
        assert body["choices"][0]["finish_reason"] == "length"
        c.wait_until(lambda: "Abort" in c.kinds("d0"))
        assert c.kinds("d0") == ["Reserve", "Abort"]  # never StartDecode


def test_stop_string_in_first_token_aborts_decode(tokenizer_dir: Path, script: list[int]) -> None:
    with Cluster(tokenizer_dir, script, PD) as c:
        body = post(c, {"prompt": "Hi", "max_tokens": 9, "stop": "H"}).json()
        assert body["choices"][0] == {
            "index": 0,
            "text": "",
            "logprobs": None,
            "finish_reason": "stop",
        }
        c.wait_until(lambda: c.kinds("d0") == ["Reserve", "Abort"])


def test_a_first_token_that_ends_the_request_aborts_both_workers(tokenizer_dir: Path) -> None:
    # P's first token is EOS: the request ends there. D never decodes, and P is told to
    # stop its KV send too (it was left to finish or time out on its own: 5 s).
    with Cluster(tokenizer_dir, [EOS], PD) as c:
        body = post(c, {"prompt": "Hi", "max_tokens": 9}).json()
        assert body["choices"][0]["finish_reason"] == "stop"
        c.wait_until(lambda: c.kinds("d0") == ["Reserve", "Abort"])
        c.wait_until(lambda: c.kinds("p0") == ["Prefill", "Abort"])


def test_stop_string_during_decode_aborts_decode(tokenizer_dir: Path, script: list[int]) -> None:
    with Cluster(tokenizer_dir, script, PD, {"d0": {"step_s": 0.05}}) as c:
        body = post(c, {"prompt": "Hi", "max_tokens": 20, "stop": ["!"]}).json()
        assert body["choices"][0]["text"] == "Hi there"
        c.wait_until(lambda: c.kinds("d0") == ["Reserve", "StartDecode", "Abort"])


def test_retryable_rejection_is_retried(tokenizer_dir: Path, script: list[int]) -> None:
    with Cluster(tokenizer_dir, script, PD, {"d0": {"reject_reserves": 2}}) as c:
        r = post(c, {"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == OUTPUT_TEXT[:2]
        assert c.kinds("d0")[:3] == ["Reserve"] * 3


def test_no_room_until_deadline_gives_503(tokenizer_dir: Path, script: list[int]) -> None:
    behaviour = {"d0": {"reject_reserves": -1}}
    with Cluster(tokenizer_dir, script, PD, behaviour, admission_timeout_s=0.4) as c:
        start = time.monotonic()
        r = post(c, {"prompt": "Hi", "max_tokens": 2})
        assert 0.4 <= time.monotonic() - start < 2.0
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "overloaded"
        assert c.kinds("p0") == []  # never half-admitted: P heard nothing
        assert c.app_state.metrics.requests["rejected"] == 1


def test_disconnect_during_prefill_aborts_both(tokenizer_dir: Path, script: list[int]) -> None:
    with Cluster(tokenizer_dir, script, PD, {"p0": {"prefill_s": 2.0}}) as c:
        try:
            post(c, {"prompt": "Hi", "stream": True}, timeout=0.3)
        except requests.exceptions.ReadTimeout:
            pass
        c.wait_until(lambda: "Abort" in c.kinds("p0") and "Abort" in c.kinds("d0"))
        c.wait_until(lambda: c.app_state.num_pending == 0)
        assert c.app_state.plane.workers["p0"].sent_prefill_tokens == 0


def test_disconnect_during_decode_aborts_decode(tokenizer_dir: Path, script: list[int]) -> None:
    with Cluster(tokenizer_dir, script, PD, {"d0": {"step_s": 0.2}}) as c:
        r = post(c, {"prompt": "Hi", "max_tokens": 20, "stream": True}, stream=True)
        next(r.iter_lines(chunk_size=1))
        r.close()
        c.wait_until(lambda: c.kinds("d0")[-1:] == ["Abort"])


def test_decode_failure_is_an_sse_error_event(tokenizer_dir: Path, script: list[int]) -> None:
    with Cluster(tokenizer_dir, script, PD, {"d0": {"fail_with": "kv transfer broke"}}) as c:
        r = post(c, {"prompt": "Hi", "max_tokens": 9, "stream": True}, stream=True)
        lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == b"data: [DONE]"
        error = json.loads(lines[-2][6:])["error"]
        assert "kv transfer broke" in error["message"] and error["type"] == "server_error"
        c.wait_until(lambda: c.app_state.metrics.requests["failed"] == 1)


def test_prefill_failing_every_time_is_502(tokenizer_dir: Path, script: list[int]) -> None:
    behaviour = {"p0": {"fail_with": "oom"}}
    with Cluster(tokenizer_dir, script, PD, behaviour, max_recoveries=1) as c:
        r = post(c, {"prompt": "Hi", "max_tokens": 9})
        assert r.status_code == 502 and "oom" in r.json()["error"]["message"]
        c.wait_until(lambda: c.kinds("d0") == ["Reserve", "Abort"] * 2)  # one re-drive
        assert len({rid for wid, _, rid in c.events if wid == "d0"}) == 2  # fresh ids
        c.wait_until(lambda: not c.app_state.plane.unacked_releases)
