"""What one request may ask of the router's event loop is capped, and checked before work.

Stop strings are matched after every token on the loop every stream shares, so their count
and length are capped; at the cap, heavy requests must not hold back a concurrent stream or
/health. Text too long to fit the context is refused before it is tokenized, and a body
declared over the limit before it is read.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest
import requests

from pdserve.model.tokenizer import Tokenizer
from tests.router.harness import EOS, Cluster

MAX_MODEL_LEN = 4096
NUM_OUTPUT_TOKENS = 1500


@pytest.fixture(scope="module")
def cluster(tokenizer_dir: Path, tokenizer: Tokenizer):
    script = tokenizer.encode("ab " * (NUM_OUTPUT_TOKENS // 3)) + [EOS]
    behaviour = {"c0": {"step_s": 0.0, "max_model_len": MAX_MODEL_LEN}}
    with Cluster(tokenizer_dir, script, {"c0": "collocated"}, behaviour) as c:
        yield c


def post(cluster: Cluster, body: dict, **kwargs) -> requests.Response:
    return requests.post(f"{cluster.url}/v1/completions", json=body, timeout=60, **kwargs)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("stop", [f"s{i}" for i in range(17)], "at most 16"),
        ("stop", ["x" * 257], "at most 256"),
        ("stop", "x" * 257, "at most 256"),
        ("stop_token_ids", list(range(3, 20)), "at most 16"),
    ],
)
def test_stop_conditions_over_the_cap_get_400(
    cluster: Cluster, field: str, value: object, words: str
) -> None:
    r = post(cluster, {"prompt": "hi", field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert words in r.json()["error"]["message"]


def test_requests_at_the_stop_cap_do_not_stall_other_streams(cluster: Cluster) -> None:
    # Never-matching stop strings at the cap, each nearly matching everywhere ("ab ab ..."),
    # on several long streams at once; a plain stream alongside must keep flowing.
    stop = [("ab " * 90)[:255] + chr(ord("A") + i) for i in range(16)]
    heavy = {"prompt": "hi", "max_tokens": NUM_OUTPUT_TOKENS, "stop": stop, "stream": True}
    results: list[str] = []

    def run_heavy() -> None:
        with post(cluster, heavy, stream=True) as r:
            lines = [line[6:] for line in r.iter_lines() if line]
        assert lines[-1] == b"[DONE]"
        results.append("".join(json.loads(e)["choices"][0]["text"] for e in lines[:-1]))

    threads = [threading.Thread(target=run_heavy) for _ in range(6)]
    for thread in threads:
        thread.start()
    gaps, health_s = [], []
    body = {"prompt": "hi", "max_tokens": 300, "stream": True}
    with post(cluster, body, stream=True) as r:
        last = time.monotonic()
        for line in r.iter_lines():
            if not line:
                continue
            now = time.monotonic()
            gaps.append(now - last)
            if len(gaps) % 50 == 1:
                assert requests.get(f"{cluster.url}/health", timeout=10).status_code == 200
                health_s.append(time.monotonic() - now)
            last = time.monotonic()
    for thread in threads:
        thread.join(60)
    assert len(gaps) == 301  # 300 chunks and [DONE]; the first gap includes admission
    assert max(gaps[1:]) < 0.5, max(gaps[1:])
    assert max(health_s) < 0.5, health_s
    assert results == ["ab " * (NUM_OUTPUT_TOKENS // 3)] * 6  # all there, nothing matched


def test_text_too_long_for_the_context_is_refused_before_tokenizing(
    cluster: Cluster, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    router_tokenizer = cluster.app_state.tokenizer
    encode = router_tokenizer.encode
    monkeypatch.setattr(router_tokenizer, "encode", lambda text: calls.append(1) or encode(text))
    too_long = "a" * (MAX_MODEL_LEN * router_tokenizer.max_token_chars + 1)
    r = post(cluster, {"prompt": too_long})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "prompt" and calls == []
    chat = {"messages": [{"role": "user", "content": too_long}]}
    r = requests.post(f"{cluster.url}/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    many = {"messages": [{"role": "user", "content": ""}] * (MAX_MODEL_LEN + 1)}
    r = requests.post(f"{cluster.url}/v1/chat/completions", json=many, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "at most 2048 entries (max_messages)" in r.json()["error"]["message"]
    # Just under the bound the prompt is tokenized and the exact count decides.
    r = post(cluster, {"prompt": "a" * MAX_MODEL_LEN})
    assert r.status_code == 400 and "4096 tokens" in r.json()["error"]["message"]
    assert calls == [1]


def test_body_declared_over_the_limit_is_refused_unread(cluster: Cluster) -> None:
    limit = cluster.config.max_body_bytes
    with socket.create_connection(("127.0.0.1", int(cluster.url.rsplit(":", 1)[1]))) as sock:
        sock.settimeout(5)
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {limit + 1}\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"prompt": "')  # the rest never comes
        reply = sock.recv(4096).decode()
    status_line, _, rest = reply.partition("\r\n")
    assert " 413 " in status_line
    assert "Too Large" in json.loads(rest.split("\r\n\r\n", 1)[1])["error"]["message"]


def test_a_client_still_uploading_an_oversized_body_reads_the_413(cluster: Cluster) -> None:
    """A 240k-message chat body (8.4 MB) sent at a network's pace: the router drains it and
    the client reads the 413, where closing at once broke its upload (a broken pipe) after
    128 KiB and it never saw an answer (issue 41)."""
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}] * 240_000}).encode()
    assert len(body) > cluster.config.max_body_bytes
    with socket.create_connection(("127.0.0.1", int(cluster.url.rsplit(":", 1)[1]))) as sock:
        sock.settimeout(10)
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode())
        for start in range(0, len(body), 1 << 16):
            sock.sendall(body[start : start + (1 << 16)])
            time.sleep(0.001)
        reply = sock.recv(4096).decode()
    assert " 413 " in reply.partition("\r\n")[0]
    assert "max_body_bytes" in reply
