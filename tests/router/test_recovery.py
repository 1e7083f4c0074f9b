"""Recovery over fake workers: a failed or lost worker's request is re-driven, the client's
stream goes on with no duplicated or missing token, and only "nothing can serve it" is an
error. (tests/faults/ does the same with real processes.)"""

from __future__ import annotations

import json
import time
from pathlib import Path

import requests

from tests.router.conftest import OUTPUT_TEXT
from tests.router.harness import Cluster

P2D2 = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}


def stream_text(c: Cluster, max_tokens: int = 12) -> tuple[str, list[dict]]:
    body = {"prompt": "Hi", "max_tokens": max_tokens, "stream": True}
    r = requests.post(f"{c.url}/v1/completions", json=body, stream=True, timeout=20)
    assert r.status_code == 200, r.text
    events = [json.loads(line[6:]) for line in r.iter_lines() if line and line != b"data: [DONE]"]
    text = "".join(e["choices"][0]["text"] for e in events if "choices" in e)
    return text, events


def generates(c: Cluster, worker_id: str) -> int:
    return c.kinds(worker_id).count("Generate")


def test_prefill_failing_once_is_prefilled_again(tokenizer_dir: Path, script: list[int]) -> None:
    behaviour = {"p0": {"fail_with": "transfer broke", "fail_times": 1}}
    with Cluster(tokenizer_dir, script, {"p0": "prefill", "d0": "decode"}, behaviour) as c:
        r = requests.post(f"{c.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 9})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == OUTPUT_TEXT[:9]
        assert c.kinds("d0") == ["Reserve", "Abort", "Reserve", "StartDecode"]


def test_decode_dying_mid_stream_continues_elsewhere(
    tokenizer_dir: Path, script: list[int]
) -> None:
    behaviour = {"d0": {"die_after_tokens": 4, "step_s": 0.02}}
    with Cluster(tokenizer_dir, script, P2D2, behaviour, policy="round_robin") as c:
        start = time.monotonic()
        text, _ = stream_text(c)
        assert text == OUTPUT_TEXT[:12]  # no token lost or repeated across the switch
        assert time.monotonic() - start < 2.0  # the dropped connection is seen at once
        assert "killed" in c.kinds("d0") and generates(c, "d1") == 1
        resumed = [w for w, kind, _ in c.events if kind == "Generate"]
        assert resumed == ["d1"]


def test_prefill_dying_mid_prefill_goes_to_another(tokenizer_dir: Path, script: list[int]) -> None:
    behaviour = {"p0": {"prefill_s": 5.0}}
    with Cluster(tokenizer_dir, script, P2D2, behaviour, policy="round_robin") as c:
        c.wait_until(lambda: c.app_state.plane.health()[0])
        with requests.Session() as s:
            future = c.loop.run_in_executor(
                None, lambda: s.post(f"{c.url}/v1/completions", json={"prompt": "Hi"})
            )
            c.wait_until(lambda: "Prefill" in c.kinds("p0"))
            c.kill("p0")
            r = c.call(asyncio_wrap(future))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == OUTPUT_TEXT[:16]
        assert c.kinds("p1") == ["Prefill"]
        rids = {rid for w, kind, rid in c.events if kind == "Reserve"}
        assert len(rids) == 2  # the decode side reserved again, under a fresh id


async def asyncio_wrap(future):  # noqa: ANN001, ANN201 - a thread-pool future as a coroutine
    return await future


def test_no_prefill_worker_left_decode_prefills_locally(
    tokenizer_dir: Path, script: list[int]
) -> None:
    with Cluster(tokenizer_dir, script, {"p0": "prefill", "d0": "decode"}) as c:
        c.kill("p0")
        c.wait_until(lambda: "prefill" not in c.app_state.plane.healthy_roles())
        r = requests.post(f"{c.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 5})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == OUTPUT_TEXT[:5]
        assert c.kinds("d0") == ["Generate"]


def test_last_decode_dying_falls_back_to_prefill(tokenizer_dir: Path, script: list[int]) -> None:
    behaviour = {"d0": {"die_after_tokens": 3}}
    with Cluster(tokenizer_dir, script, {"p0": "prefill", "d0": "decode"}, behaviour) as c:
        text, _ = stream_text(c, max_tokens=8)
        assert text == OUTPUT_TEXT[:8]
        assert c.kinds("p0") == ["Prefill", "Generate"]


def test_nothing_left_to_serve_is_a_clear_error(tokenizer_dir: Path, script: list[int]) -> None:
    behaviour = {"d0": {"die_after_tokens": 3}, "p0": {"die_after_tokens": 4}}
    with Cluster(tokenizer_dir, script, {"p0": "prefill", "d0": "decode"}, behaviour) as c:
        text, events = stream_text(c, max_tokens=8)
        assert text == OUTPUT_TEXT[:7]  # 4 from P then d0, 3 more from p0: all kept, none twice
        error = events[-1]["error"]
        assert error["code"] == "overloaded" and "no healthy worker" in error["message"]
        r = requests.post(f"{c.url}/v1/completions", json={"prompt": "Hi"})
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"


def test_silent_decode_is_lost_within_the_heartbeat_timeout(
    tokenizer_dir: Path, script: list[int]
) -> None:
    behaviour = {"d0": {"step_s": 30.0}}  # hangs after StartDecode
    with Cluster(
        tokenizer_dir, script, P2D2, behaviour, policy="round_robin", heartbeat_timeout_s=0.5
    ) as c:
        body = {"prompt": "Hi", "max_tokens": 6, "stream": True}
        r = requests.post(f"{c.url}/v1/completions", json=body, stream=True, timeout=10)
        lines = r.iter_lines()
        next(lines)  # the first token, from p0
        c.workers["d0"].heartbeat = False
        start = time.monotonic()
        rest = [json.loads(x[6:]) for x in lines if x and x != b"data: [DONE]"]
        assert time.monotonic() - start < 0.5 + 1.5
        assert OUTPUT_TEXT[0] + "".join(e["choices"][0]["text"] for e in rest) == OUTPUT_TEXT[:6]
        assert generates(c, "d1") == 1
        c.wait_until(lambda: "Abort" in c.kinds("d0"))  # the hung attempt is aborted too


def test_every_abort_is_acknowledged(tokenizer_dir: Path, script: list[int]) -> None:
    with Cluster(tokenizer_dir, script, {"p0": "prefill", "d0": "decode"}) as c:
        body = {"prompt": "Hi", "max_tokens": 9, "stop": "H"}
        assert requests.post(f"{c.url}/v1/completions", json=body).status_code == 200
        c.wait_until(lambda: "Abort" in c.kinds("d0"))
        c.wait_until(lambda: not c.app_state.plane.unacked_releases)
        metrics = requests.get(f"{c.url}/metrics").text
        assert 'pdserve_unacked_releases{worker="d0"} 0' in metrics
