"""End to end through HTTP: 1 prefill + 1 decode worker give the collocated worker's greedy
output token for token, for every transfer backend and mode, and free every block after."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest

from pdserve.cluster.config import WorkerGroup
from pdserve.transfer import KVTransferConfig
from tests.cluster.conftest import get_text, post, role, start
from tests.transfer.conftest import needs_mooncake

NUM_PROMPTS = 4


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    # Token ids of printable bytes; lengths straddle block (16) and chunk boundaries.
    return [[rng.randrange(40, 120) for _ in range(n)] for n in (5, 16, 37, 70)]


def complete_all(url: str, model: str) -> list[tuple[str, int]]:
    outs = []
    for p in prompts():
        r = post(
            url,
            "/v1/completions",
            {
                "model": model,
                "prompt": p,
                "max_tokens": 12,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        outs.append((r["choices"][0]["text"], r["usage"]["completion_tokens"]))
    return outs


def kv_blocks(url: str) -> dict[str, tuple[int, int]]:
    """worker -> (free, total) from /metrics."""
    text = get_text(url, "/metrics")
    free = dict(re.findall(r'pdserve_kv_blocks_free\{worker="([^"]+)"\} (\d+)', text))
    total = dict(re.findall(r'pdserve_kv_blocks_total\{worker="([^"]+)"\} (\d+)', text))
    return {w: (int(free[w]), int(total[w])) for w in free}


def wait_blocks_free(url: str, timeout_s: float = 10) -> dict[str, tuple[int, int]]:
    deadline = time.monotonic() + timeout_s
    while True:
        blocks = kv_blocks(url)
        if all(f == t for f, t in blocks.values()) or time.monotonic() > deadline:
            return blocks
        time.sleep(0.2)


@pytest.fixture(scope="module")
def reference(tiny_served_model):
    with start(tiny_served_model, collocated=role()) as url:
        return complete_all(url, str(tiny_served_model))


@pytest.mark.parametrize("backend", ["shm", "tcp", pytest.param("mooncake", marks=needs_mooncake)])
@pytest.mark.parametrize("mode", ["layerwise", "full"])
def test_1p1d_equals_collocated(tiny_served_model, reference, backend, mode):
    model = str(tiny_served_model)
    store = KVTransferConfig(backend=backend, mode=mode)
    # Chunks of 24 tokens make the longer prompts cross several prefill steps.
    with start(
        tiny_served_model,
        prefill=role(long_prefill_token_threshold=24),
        decode=role(),
        kv_transfer=store,
    ) as url:
        assert complete_all(url, model) == reference
        # Worker stats arrive with the heartbeat: wait until they report the transfers.
        deadline = time.monotonic() + 10
        sent = r"pdserve_kv_transfer_bytes_total\S*sent\S* [1-9]"
        while not re.search(sent, get_text(url, "/metrics")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert re.search(sent, get_text(url, "/metrics"))
        # Again: the decode worker now holds each prompt's full blocks but the last (0, 0,
        # 2 and 4 of 16 tokens) and receives only the rest, with the same output.
        assert complete_all(url, model) == reference
        skipped = 'pdserve_kv_transfer_skipped_blocks_total{worker="decode-0"} 6'
        while skipped not in get_text(url, "/metrics") and time.monotonic() < deadline + 10:
            time.sleep(0.2)
        assert skipped in get_text(url, "/metrics")
        blocks = wait_blocks_free(url)
        assert set(blocks) == {"prefill-0", "decode-0"}
        assert all(free == total for free, total in blocks.values()), blocks


def test_openai_client_streams_chat(tiny_served_model):
    openai = pytest.importorskip("openai")
    with start(tiny_served_model, prefill=role(), decode=role()) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        stream = client.chat.completions.create(
            model=str(tiny_served_model),
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].usage.completion_tokens >= 1
        assert any(c.choices and c.choices[0].finish_reason for c in chunks)


def _pdserve_children(port: int) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "pdserve." in cmdline and (f":{port}" in cmdline or f'"port": {port}' in cmdline):
            pids.append(int(pid))
    return pids


def test_pdserve_up_then_ctrl_c_leaves_no_process(tiny_served_model, tmp_path):
    from pdserve.cluster.launcher import free_port

    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "up",
            "--model",
            str(tiny_served_model),
            "--port",
            str(port),
            "--kv-cache-bytes",
            str(256 * 16 * 512),
            "--threads",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        line = ""
        while "serving the OpenAI API" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "pdserve up exited early"
        assert _pdserve_children(port), "no worker or router process found"
        proc.send_signal(signal.SIGINT)
        # communicate, not wait: it drains the pipe (a full pipe would block the shutdown
        # logs) and keeps the output for the failure message
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out[-3000:]
        time.sleep(0.5)
        assert _pdserve_children(port) == []
    finally:
        if proc.poll() is None:
            proc.kill()


def test_prefix_cache_routing_sends_a_repeated_prefix_back(tiny_served_model):
    """Two workers; a repeated long prompt is routed to the one that cached it (its usage
    reports the cached tokens), while round robin would alternate."""
    model = str(tiny_served_model)
    prompt = [60 + i % 50 for i in range(200)]
    with start(tiny_served_model, collocated=role(num=2)) as url:

        def cached() -> int:
            body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
            return post(url, "/v1/completions", body)["usage"]["prompt_tokens_details"][
                "cached_tokens"
            ]

        assert cached() == 0
        time.sleep(1.0)  # the worker's KVEvents reach the router
        assert [cached() for _ in range(3)] == [192, 192, 192]  # 12 of 12 full blocks hit


def test_1p1d_with_a_decode_budget_drops_before_the_transfer(tiny_served_model):
    """Only the decode role has a budget (64 tokens = 4 blocks of 16): the prefill worker
    drops the long prompts before sending, and the output is the collocated engine's with
    the same budget (both drop right after the unchunked prompt, by the same scores)."""
    model = str(tiny_served_model)
    budget = {"kv_budget_tokens": 64, "kv_sink_tokens": 16, "kv_recent_tokens": 16}
    rng = random.Random(3)
    long_prompts = [[rng.randrange(40, 120) for _ in range(n)] for n in (70, 130, 20)]

    def complete(url: str) -> list[str]:
        return [
            post(
                url,
                "/v1/completions",
                {
                    "model": model,
                    "prompt": p,
                    "max_tokens": 24,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )["choices"][0]["text"]
            for p in long_prompts
        ]

    with start(tiny_served_model, collocated=role(**budget)) as url:
        reference = complete(url)
    store = KVTransferConfig(backend="tcp", mode="layerwise")
    with start(tiny_served_model, prefill=role(), decode=role(**budget), kv_transfer=store) as url:
        assert complete(url) == reference
        # 4 + 4 + 2 blocks crossed (5 + 9 + 2 without the budget), 8 KiB each.
        expected = 10 * 2 * 2 * 2 * 16 * 16 * 4  # blocks * layers * K,V * heads * tokens * dims
        sent, deadline = 0, time.monotonic() + 10
        while sent != expected and time.monotonic() < deadline:  # stats lag a heartbeat
            time.sleep(0.2)
            match = re.search(
                r"pdserve_kv_transfer_bytes_total\S*sent\S* (\d+)", get_text(url, "/metrics")
            )
            sent = int(match.group(1)) if match else 0
        assert sent == expected
        blocks = wait_blocks_free(url)
        assert all(free == total for free, total in blocks.values()), blocks


WORKERS = ("collocated-0", "collocated-1")


def _pins(url: str, expected: list[int], timeout_s: float = 15) -> list[int]:
    """Each worker's pinned blocks, once they equal `expected` (heartbeats carry them)."""
    deadline = time.monotonic() + timeout_s
    while True:
        pins = [_metric(url, "pdserve_kv_blocks_pinned", w) for w in WORKERS]
        if pins == expected or time.monotonic() > deadline:
            return pins
        time.sleep(0.2)


def _metric(url: str, name: str, worker: str, extra: str = "") -> int:
    """A worker's sample; `extra` holds the labels that sort before `worker` (the exposition
    lists labels in name order)."""
    match = re.search(rf'{name}\{{{extra}worker="{worker}"\}} (\d+)', get_text(url, "/metrics"))
    return int(match.group(1)) if match else -1


def test_warmup_prompts_are_pinned_on_every_worker_and_hit_at_once(tiny_served_model):
    """The launcher warms `warmup_prompts` on both collocated workers; the very first request
    with that prefix hits wherever it goes (round robin), and `pdserve warmup --unpin`
    releases the pins."""
    model = str(tiny_served_model)
    system = "".join(chr(60 + i % 50) for i in range(100))  # 100 byte tokens: 6 full blocks
    pipeline = dict(
        collocated=role(num=2), routing="round_robin", warmup_prompts=[system], admin_key="operator"
    )
    with start(tiny_served_model, **pipeline) as url:
        assert _pins(url, [6, 6]) == [6, 6]
        body = {"model": model, "prompt": system + "Go.", "max_tokens": 2, "temperature": 0}
        for _ in range(2):  # one request per worker
            usage = post(url, "/v1/completions", body)["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] == 96
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "pdserve.cli",
                "warmup",
                "--url",
                url,
                "--unpin",
                "--prompt",
                system,
                "--admin-key",
                "operator",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert sorted(line.split(" [")[0] for line in out.stdout.splitlines()) == list(WORKERS)
        assert "96/100 tokens cached, 96 unpinned" in out.stdout
        assert _pins(url, [0, 0]) == [0, 0]
        assert wait_blocks_free(url) == {w: (256, 256) for w in WORKERS}
        hit = _metric(url, "pdserve_worker_prompt_tokens_total", WORKERS[0], 'source="cached",')
        assert hit == 96


def test_a_prompt_beyond_the_unpinned_room_is_a_fast_400(tiny_served_model):
    """The prefill worker's 16 blocks are 12 pinned by the launcher's warm-up (with the admin
    key it made): a prompt that fits the 256-token context but not the 4 unpinned blocks is
    refused at once, naming its length and the room; a small request still completes."""
    import urllib.error

    model = str(tiny_served_model)
    system = "".join(chr(60 + i % 50) for i in range(192))  # 12 full blocks of 16
    small = 16 * 16 * 512
    prefill = WorkerGroup(kv_cache_bytes=small, threads=1, max_pinned_fraction=0.75)
    pipeline = dict(prefill=prefill, decode=role(), warmup_prompts=[system])
    with start(tiny_served_model, **pipeline) as url:
        start_s = time.monotonic()
        body = {"model": model, "prompt": "x" * 150, "max_tokens": 2, "temperature": 0}
        with pytest.raises(urllib.error.HTTPError) as refused:
            post(url, "/v1/completions", body)
        assert refused.value.code == 400 and time.monotonic() - start_s < 10
        message = json.loads(refused.value.read())["error"]["message"]
        assert "prompt has 150 tokens" in message and "room for 63" in message, message
        body = {"model": model, "prompt": "Go.", "max_tokens": 2, "temperature": 0}
        assert post(url, "/v1/completions", body)["usage"]["completion_tokens"] == 2
