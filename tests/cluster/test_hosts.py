"""Prefill and decode workers on different hosts: network namespaces with their own address
and /dev/shm on a private bridge (pdserve/testing/netns.py), placed by the launcher
(`Placement`). `--transfer auto` must find no shared /dev/shm and use tcp, the router must
reach each worker at its namespace's address, and the tokens must equal a collocated run."""

from __future__ import annotations

import json
import re
import time

import pytest
import requests

from pdserve.cluster.config import Pipeline, WorkerGroup
from pdserve.cluster.launcher import Cluster, Placement, free_port
from pdserve.testing.netns import Hosts, Link, available
from pdserve.transfer import KVTransferConfig
from tests.cluster.conftest import KV_BYTES, get_text, post, role
from tests.cluster.test_cluster import kv_blocks
from tests.transfer.conftest import needs_mooncake

pytestmark = pytest.mark.skipif(bool(available()), reason=available() or "available")

PROMPTS = [[40 + i] * (9 + 23 * i) for i in range(4)]  # up to 78 tokens: several blocks


def complete_all(url: str, model: str) -> list[str]:
    bodies = [
        {"model": model, "prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        for p in PROMPTS
    ]
    return [post(url, "/v1/completions", b)["choices"][0]["text"] for b in bodies]


def placements(hosts: Hosts) -> dict[str, Placement]:
    placed = {"router": Placement(hosts.gateway)}
    for name in hosts.names:
        placed[name] = Placement(hosts.ip(name), tuple(hosts.prefix_of(name)))
    return placed


BACKENDS = ["auto", pytest.param("mooncake", marks=needs_mooncake)]


def split_run(
    model: str, prefill: WorkerGroup, decode: WorkerGroup, capfd, backend: str = "auto"
) -> list[str]:
    store = KVTransferConfig(backend=backend)
    pipeline = Pipeline(
        model=model, port=free_port(), prefill=prefill, decode=decode, kv_transfer=store
    )
    with Hosts(["prefill-0", "decode-0"], prefix="pdtc") as hosts:
        cluster = Cluster(pipeline, log_level="WARNING", placements=placements(hosts))
        with cluster as url:
            texts = complete_all(url, model)
            sent = r'pdserve_kv_transfer_bytes_total\{direction="sent",worker="prefill-0"\} [1-9]'
            deadline = time.monotonic() + 10
            while not re.search(sent, get_text(url, "/metrics")):
                assert time.monotonic() < deadline, "no KV bytes reported sent"
                time.sleep(0.2)
    # tcp chosen up front (the decode worker's segment is not seen), not shm tried and failed
    assert "shm unavailable" not in capfd.readouterr().err
    return texts


@pytest.mark.parametrize("backend", BACKENDS)
def test_1p1d_on_two_hosts_equals_collocated(tiny_served_model, capfd, backend):
    model = str(tiny_served_model)
    with Cluster(Pipeline(model=model, port=free_port(), collocated=role()), "WARNING") as url:
        reference = complete_all(url, model)
    small = WorkerGroup(kv_cache_bytes=KV_BYTES, threads=1, long_prefill_token_threshold=24)
    assert split_run(model, small, small, capfd, backend) == reference


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("backend", BACKENDS)
def test_1p1d_on_two_hosts_equals_collocated_on_the_default_model(capfd, backend):
    model, one = "smollm2-135m", WorkerGroup(kv_cache_bytes=64 * 2**20, threads=1)
    with Cluster(Pipeline(model=model, port=free_port(), collocated=one), "WARNING") as url:
        reference = complete_all(url, model)
    assert split_run(model, one, one, capfd, backend) == reference


# ---- link faults --------------------------------------------------------------------------

LONG_PROMPT = [40 + i % 80 for i in range(200)]  # ~100 KB of KV: seconds at 200 kbit/s
END_BOUND_S = 30.0  # heartbeat timeout (3 s) + re-drive + the rest of the stream, with margin


def counted(url: str, name: str, **labels: str) -> float:
    total = 0.0
    text = get_text(url, "/metrics")
    for found, value in re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.MULTILINE):
        if set(labels.items()) <= set(re.findall(r'(\w+)="([^"]*)"', found)):
            total += float(value)
    return total


def blocks_back(url: str, workers: set[str], timeout_s: float = 20.0) -> None:
    """Every worker of `workers` reports all its KV blocks free (no leak) within the bound."""
    deadline = time.monotonic() + timeout_s
    while True:
        blocks = kv_blocks(url)
        if set(blocks) >= workers and all(blocks[w][0] == blocks[w][1] for w in workers):
            return
        assert time.monotonic() < deadline, f"KV blocks not back: {blocks}"
        time.sleep(0.2)


def stream_after_first(url: str, model: str, fault) -> tuple[str, float]:  # noqa: ANN001
    """Stream LONG_PROMPT's completion, run `fault()` after the first token; the whole
    text and the seconds from the fault to the stream's end."""
    body = {
        "model": model,
        "prompt": LONG_PROMPT,
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    text, faulted_at = "", None
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "choices" in chunk, chunk  # an error event: what went wrong
            text += chunk["choices"][0]["text"]
            if faulted_at is None:
                fault()
                faulted_at = time.monotonic()
    return text, time.monotonic() - faulted_at


@pytest.fixture
def split(tiny_served_model, request):
    """A 1P1D cluster across two hosts, unsupervised (a host the test removed stays gone),
    with the reference text of LONG_PROMPT from the unshaped link; the transfer backend is
    the test's indirect parameter (auto: tcp between the hosts)."""
    model = str(tiny_served_model)
    small = WorkerGroup(kv_cache_bytes=KV_BYTES, threads=1, long_prefill_token_threshold=64)
    store = KVTransferConfig(backend=getattr(request, "param", "auto"))
    pipeline = Pipeline(
        model=model, port=free_port(), prefill=small, decode=small, kv_transfer=store
    )
    with Hosts(["prefill-0", "decode-0"], prefix="pdtf") as hosts:
        cluster = Cluster(pipeline, "WARNING", restart=None, placements=placements(hosts))
        with cluster as url:
            body = {
                "model": model,
                "prompt": LONG_PROMPT,
                "max_tokens": 16,
                "temperature": 0,
                "ignore_eos": True,
            }
            reference = post(url, "/v1/completions", body)["choices"][0]["text"]
            hosts.shape("decode-0", Link(rate="200kbit"))
            yield hosts, url, model, reference


@pytest.mark.parametrize("split", BACKENDS, indirect=True)
def test_a_link_cut_mid_transfer_is_detected_and_the_request_finishes(split):
    hosts, url, model, reference = split
    text, after_s = stream_after_first(url, model, lambda: hosts.set_link("decode-0", up=False))
    assert (text, after_s < END_BOUND_S) == (reference, True), after_s
    # Served whole by the prefill worker, and both fallbacks are on /metrics.
    assert counted(url, "pdserve_request_redrives_total", worker="decode-0") >= 1
    assert counted(url, "pdserve_local_prefill_fallbacks_total", worker="prefill-0") >= 1
    hosts.set_link("decode-0", up=True)
    blocks_back(url, {"prefill-0", "decode-0"})


@pytest.mark.parametrize("split", BACKENDS, indirect=True)
def test_a_decode_host_that_disappears_leaks_no_prefill_blocks(split):
    hosts, url, model, reference = split
    text, after_s = stream_after_first(url, model, lambda: hosts.remove("decode-0"))
    assert (text, after_s < END_BOUND_S) == (reference, True), after_s
    assert counted(url, "pdserve_local_prefill_fallbacks_total", worker="prefill-0") >= 1
    blocks_back(url, {"prefill-0"})  # the send to the vanished host does not pin them
