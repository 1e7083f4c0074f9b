"""Fault injection on a real 2 prefill + 2 decode cluster (CPU, tiny model).

For each stage a request can be in and each fault, the request ends within END_BOUND_S
(completed: its greedy text equals the fault-free reference; or a clear error where nothing
could serve it), and every surviving worker's free blocks return to the baseline.

    stage         how a test holds a request there
    queued        both decode workers SIGSTOPped: Reserve sent, not answered
    prefilling    both prefill workers SIGSTOPped: reserved on D, Prefill sent, not run
    transferring  transfer fault `delay_s`: first token out, KV still in flight
    decoding      a long completion, faulted after a few streamed tokens

                  disconnect  P killed  D killed  message dropped  fails mid-layer
    queued            x          x         x           -                -
    prefilling        x          x         x           -                -
    transferring      x          x         x           x                x
    decoding          x          -(1)      x           -                -

(1) P holds nothing once its KV has landed. A transfer fault only exists while transferring.
"""

from __future__ import annotations

import json
import random
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests

from tests.faults.conftest import (
    END_BOUND_S,
    FaultCluster,
    assert_blocks_back,
    counted,
    router_active,
)

PREFILLS, DECODES = ("prefill-0", "prefill-1"), ("decode-0", "decode-1")
_seeds = iter(range(1000))


@pytest.fixture(autouse=True)
def _healed(cluster: FaultCluster):
    yield
    cluster.heal()


def new_prompt() -> list[int]:
    rng = random.Random(next(_seeds))
    return [rng.randrange(40, 120) for _ in range(90)]  # 6 blocks, 3 prefill chunks


def body(prompt: list[int], max_tokens: int, **kw: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **kw}


def complete(c: FaultCluster, prompt: list[int], max_tokens: int = 24) -> str:
    start = time.monotonic()
    r = requests.post(c.url + "/v1/completions", json=body(prompt, max_tokens), timeout=30)
    assert r.status_code == 200, r.text
    assert time.monotonic() - start < END_BOUND_S
    return r.json()["choices"][0]["text"]


class Stream:
    """A streamed completion read event by event."""

    def __init__(self, c: FaultCluster, prompt: list[int], max_tokens: int) -> None:
        self.start = time.monotonic()
        self.response = requests.post(
            c.url + "/v1/completions",
            json=body(prompt, max_tokens, stream=True),
            stream=True,
            timeout=30,
        )
        assert self.response.status_code == 200, self.response.text
        self._lines = self.response.iter_lines()
        self.text = ""

    def read(self, num_events: int | None = None) -> str:
        for line in self._lines:
            if not line or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            self.text += event["choices"][0]["text"]
            if num_events is not None:
                num_events -= 1
                if num_events == 0:
                    return self.text
        assert time.monotonic() - self.start < END_BOUND_S
        return self.text


def wait_for(predicate: Callable[[], Any], timeout_s: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return value


def holder(c: FaultCluster, role_workers: tuple[str, ...]) -> str:
    """The worker of `role_workers` the router has the (only) request on right now."""
    return wait_for(lambda: next((w for w in role_workers if router_active(c.url)[w]), None))


# ---- client disconnects -------------------------------------------------------------------


@pytest.mark.parametrize("stage", ["queued", "prefilling"])
def test_disconnect_while_held(cluster: FaultCluster, stage: str) -> None:
    held = DECODES if stage == "queued" else PREFILLS
    cluster.signal(held, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:
            post = pool.submit(
                requests.post,
                cluster.url + "/v1/completions",
                json=body(new_prompt(), 24),
                timeout=(5, 1.5),
            )
            holder(cluster, held)
            with pytest.raises(requests.exceptions.ReadTimeout):
                post.result()
    finally:
        cluster.signal(held, signal.SIGCONT)
    assert_blocks_back(cluster.url)
    assert wait_for(lambda: all(n == 0 for n in router_active(cluster.url).values()))
    complete(cluster, new_prompt())  # the next request is served


@pytest.mark.parametrize("stage", ["transferring", "decoding"])
def test_disconnect_while_streaming(cluster: FaultCluster, stage: str) -> None:
    if stage == "transferring":
        cluster.inject("delay_s:1.0")
    stream = Stream(cluster, new_prompt(), max_tokens=24 if stage == "transferring" else 300)
    stream.read(1 if stage == "transferring" else 3)
    stream.response.close()
    assert_blocks_back(cluster.url)
    complete(cluster, new_prompt())


# ---- transfer faults ----------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["drop_done", "fail_after_layer:0"])
def test_transfer_fault_recovers(cluster: FaultCluster, fault: str) -> None:
    prompt = new_prompt()
    reference = complete(cluster, prompt)
    redrives = counted(cluster.url, "pdserve_request_redrives_total", reason="failed")
    failures = counted(cluster.url, "pdserve_kv_transfer_failures_total")
    cluster.inject(fault)
    assert complete(cluster, prompt) == reference
    assert not cluster.fault_file.exists()  # the fault did fire
    assert_blocks_back(cluster.url)
    # The answer came by a re-drive: counted at the router and by the worker that saw it.
    assert counted(cluster.url, "pdserve_request_redrives_total", reason="failed") > redrives
    assert wait_for(lambda: counted(cluster.url, "pdserve_kv_transfer_failures_total") > failures)


# ---- workers killed -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stage", "victim_role"),
    [
        ("queued", "decode"),
        ("queued", "prefill"),
        ("prefilling", "prefill"),
        ("prefilling", "decode"),
    ],
)
def test_worker_killed_before_first_token(
    cluster: FaultCluster, stage: str, victim_role: str
) -> None:
    prompt = new_prompt()
    reference = complete(cluster, prompt)
    held = DECODES if stage == "queued" else PREFILLS
    cluster.signal(held, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:
            result = pool.submit(complete, cluster, prompt)
            holder(cluster, held)  # the request is held at `stage` now
            if stage == "queued" and victim_role == "prefill":
                victim = PREFILLS[0]  # idle yet: the request must not be sent to it later
            else:
                victim = holder(cluster, DECODES if victim_role == "decode" else PREFILLS)
            cluster.signal([victim], signal.SIGKILL)
            cluster.signal([w for w in held if w != victim], signal.SIGCONT)
            assert result.result() == reference
    finally:
        cluster.heal()
    assert_blocks_back(cluster.url)


def test_decode_killed_while_transferring(cluster: FaultCluster) -> None:
    prompt = new_prompt()
    reference = complete(cluster, prompt)
    cluster.inject("delay_s:1.0")
    stream = Stream(cluster, prompt, max_tokens=24)
    stream.read(1)
    cluster.signal([holder(cluster, DECODES)], signal.SIGKILL)
    assert stream.read() == reference
    assert_blocks_back(cluster.url)


def test_decode_killed_while_decoding(cluster: FaultCluster) -> None:
    prompt = new_prompt()
    reference = complete(cluster, prompt, max_tokens=300)
    stream = Stream(cluster, prompt, max_tokens=300)
    stream.read(3)
    cluster.signal([holder(cluster, DECODES)], signal.SIGKILL)
    assert stream.read() == reference
    assert_blocks_back(cluster.url)


def test_prefills_killed_while_transferring_then_decode_prefills(cluster: FaultCluster) -> None:
    prompt, later = new_prompt(), new_prompt()
    reference, later_reference = complete(cluster, prompt), complete(cluster, later)
    cluster.inject("delay_s:1.0")
    stream = Stream(cluster, prompt, max_tokens=24)
    stream.read(1)
    cluster.signal(PREFILLS, signal.SIGKILL)  # the sending one among them
    assert stream.read() == reference
    local = counted(cluster.url, "pdserve_local_prefill_fallbacks_total", reason="no_prefill")
    assert complete(cluster, later) == later_reference  # no P left: D prefills locally
    assert_blocks_back(cluster.url)
    after = counted(cluster.url, "pdserve_local_prefill_fallbacks_total", reason="no_prefill")
    assert after == local + 1
    assert counted(cluster.url, "pdserve_request_redrives_total", reason="lost") >= 1
