"""The per-token path of a stream: chunk bytes made from a per-response template, waits for
tokens that arm no timer, and the bytes a client gets unchanged by either."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
import requests

from pdserve.router import responses
from tests.router.conftest import OUTPUT_TEXT
from tests.router.harness import Cluster

TEXTS = [
    "",
    "a",
    ' "quoted" \\ back/slash',
    "naïve ✓ 日本 🤖",
    "\x00\n\t\x1f",
    "\x00pdserve-text\x00",
]


@pytest.mark.parametrize("chat", [False, True])
def test_a_token_chunk_is_the_bytes_of_its_whole_body(chat: bool) -> None:
    ctx = responses.ResponseContext(chat, 'model "x" ✓')
    for text in TEXTS:
        expected = responses.sse(responses.body(ctx, text, stream=True))
        assert ctx.text_chunk(text) == expected


@pytest.fixture(scope="module")
def cluster(tokenizer_dir: Path, script: list[int]):
    with Cluster(tokenizer_dir, script, {"c0": "collocated"}) as c:
        yield c


@pytest.fixture
def timers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Who armed each asyncio.timeout() while a token was awaited: the driver's wait for the
    next message (`_next`)."""
    armed: list[str] = []
    original = asyncio.timeout

    def counted(delay: float | None):
        caller = sys._getframe(1).f_code.co_name
        if caller == "_next":
            armed.append(caller)
        return original(delay)

    monkeypatch.setattr(asyncio, "timeout", counted)
    return armed


def _stream(cluster: Cluster, endpoint: str, max_tokens: int) -> str:
    body = {"max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == "chat/completions":
        body["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        body["prompt"] = "Hi"
    r = requests.post(f"{cluster.url}/v1/{endpoint}", json=body, stream=True)
    lines = [line.removeprefix("data: ") for line in r.iter_lines(decode_unicode=True) if line]
    assert lines[-1] == "[DONE]"
    choices = [json.loads(line)["choices"] for line in lines[:-1]]
    if endpoint == "chat/completions":
        return "".join(c[0]["delta"].get("content") or "" for c in choices if c)
    return "".join(c[0]["text"] for c in choices if c)


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_a_token_wait_arms_no_timer(cluster: Cluster, timers: list, endpoint: str) -> None:
    # One per token before, for the wait.
    assert _stream(cluster, endpoint, 100) == OUTPUT_TEXT
    assert timers == []
