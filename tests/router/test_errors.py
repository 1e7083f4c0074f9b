"""Bad input gets a 4xx with OpenAI error JSON naming the problem, and the server stays up."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from tests.router.harness import Cluster

MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def cluster(tokenizer_dir: Path, script: list[int]):
    # max_model_len 32 (from Ready) makes "too long" cheap to hit; tiny body limit for 413.
    behaviour = {"c0": {"max_model_len": 32}}
    with Cluster(tokenizer_dir, script, {"c0": "collocated"}, behaviour, max_body_bytes=4096) as c:
        yield c


CASES = [
    # (route, body, status, param)
    ("completions", {"max_tokens": 2}, 400, "prompt"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": 5}, 400, "prompt"),
    ("completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("completions", {"prompt": [1, -2]}, 400, "prompt"),
    ("completions", {"prompt": [100000]}, 400, "prompt"),
    ("completions", {"prompt": "x" * 40}, 400, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": 31}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 10**12}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("completions", {"prompt": "hi", "top_k": -5}, 400, "top_k"),
    ("completions", {"prompt": "hi", "seed": "s"}, 400, "seed"),
    ("completions", {"prompt": "hi", "stop": 3}, 400, "stop"),
    ("completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream"),
    ("completions", {"prompt": "hi", "n": 17}, 400, "n"),
    ("completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("completions", {"prompt": "hi", "n": "2"}, 400, "n"),
    ("completions", {"prompt": "hi", "n": 3, "best_of": 2}, 400, "best_of"),
    ("completions", {"prompt": "hi", "best_of": 2, "stream": True}, 400, "best_of"),
    ("chat/completions", {"messages": MSGS, "best_of": 2}, 400, "best_of"),
    ("completions", {"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("completions", {"prompt": "hi", "frequency_penalty": "x"}, 400, "frequency_penalty"),
    ("completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("completions", {"prompt": "hi", "min_tokens": -1}, 400, "min_tokens"),
    ("completions", {"prompt": "hi", "min_tokens": 6, "max_tokens": 5}, 400, "min_tokens"),
    ("completions", {"prompt": "hi", "logit_bias": [1]}, 400, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"a": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"-1": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"5": "x"}}, 400, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"100000": 1}}, 400, "logit_bias"),
    (
        "completions",
        {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(301)}},
        400,
        "logit_bias",
    ),
    ("completions", {"prompt": "hi", "echo": "yes"}, 400, "echo"),
    ("completions", {"prompt": "hi", "echo": 1}, 400, "echo"),
    ("chat/completions", {"messages": MSGS, "echo": True}, 400, "echo"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "echo": True, "max_tokens": -1}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "echo": True, "logprobs": 21}, 400, "logprobs"),
    ("completions", {"prompt": "hi", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("completions", {"prompt": "hi", "logprobs": True}, 400, "logprobs"),
    ("completions", {"prompt": "hi", "model": 7}, 400, "model"),
    ("completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("completions", [1, 2], 400, None),
    ("completions", None, 400, None),
    ("completions", {"prompt": "hi", "temperature": 1e9}, 400, "temperature"),
    ("completions", {"prompt": "hi", "top_k": 1.5}, 400, "top_k"),
    ("completions", {"prompt": "hi", "stop_token_ids": "x"}, 400, "stop_token_ids"),
    ("completions", {"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("completions", {"prompt": "hi", "seed": 1.5}, 400, "seed"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages"),
    ("chat/completions", {"messages": MSGS, "max_tokens": 10**12}, 400, "max_tokens"),
    ("chat/completions", {}, 400, "messages"),
    ("chat/completions", {"messages": "hi"}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user"}]}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages"),
    ("chat/completions", {"messages": MSGS, "max_completion_tokens": -3}, 400, "max_tokens"),
    ("chat/completions", {"messages": MSGS, "logprobs": 1}, 400, "logprobs"),
    ("chat/completions", {"messages": MSGS, "top_logprobs": 2}, 400, "top_logprobs"),
    (
        "chat/completions",
        {"messages": MSGS, "logprobs": True, "top_logprobs": -1},
        400,
        "top_logprobs",
    ),
    # Out of range: nothing past 64 bits reaches msgpack, float() or a comparison that lies.
    ("completions", {"prompt": "hi", "seed": 2**64}, 400, "seed"),
    ("completions", {"prompt": "hi", "seed": -(2**63) - 1}, 400, "seed"),
    ("completions", {"prompt": "hi", "top_k": 2**70}, 400, "top_k"),
    ("completions", {"prompt": "hi", "temperature": 10**400}, 400, "temperature"),
    ("completions", {"prompt": "hi", "top_p": -(10**30)}, 400, "top_p"),
    ("completions", {"prompt": "hi", "stop_token_ids": [2**64]}, 400, "stop_token_ids"),
    ("completions", {"prompt": [2**64]}, 400, "prompt"),
    (
        "chat/completions",
        {"messages": MSGS, "max_completion_tokens": 2**80},
        400,
        "max_completion_tokens",
    ),
    # Lone surrogates have no UTF-8 form: neither the tokenizer nor msgpack can take them.
    ("completions", {"prompt": "hi \ud800"}, 400, "prompt"),
    ("completions", {"prompt": "hi", "stop": ["\udfff"]}, 400, "stop[0]"),
    ("completions", {"prompt": "hi", "model": "\ud800"}, 400, "model"),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "\udc00"}]},
        400,
        "messages[0].content",
    ),
    # Content parts must be text parts holding text.
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": {"a": 1}}]}]},
        400,
        "messages",
    ),
]


@pytest.mark.parametrize(("route", "body", "status", "param"), CASES)
def test_bad_request_gets_error_json(
    cluster: Cluster, route: str, body: object, status: int, param: str | None
) -> None:
    r = requests.post(f"{cluster.url}/v1/{route}", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert param is None or param.split("_")[0] in error["message"].lower()  # names the field
    if status == 404:
        assert error["code"] == "model_not_found"
    assert_still_serves(cluster)


def assert_still_serves(cluster: Cluster) -> None:
    r = requests.post(f"{cluster.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Hi "


@pytest.mark.parametrize(
    ("data", "status", "words"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b'{"prompt": "\xff\xfe"}', 400, "UTF-8"),
        (b"x" * 5000, 413, "Too Large"),
    ],
)
def test_malformed_bodies(cluster: Cluster, data: bytes, status: int, words: str) -> None:
    r = requests.post(f"{cluster.url}/v1/completions", data=data)
    assert r.status_code == status and words in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert_still_serves(cluster)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(
    ("data", "param", "words"),
    [
        # Python's int() takes any length up to 4,300 digits, then raises ValueError (a 500).
        (b'{"prompt": "hi", "seed": 1' + b"0" * 4000 + b"}", "seed", "64 bits"),
        (b'{"prompt": "hi", "top_k": -' + b"9" * 30 + b"}", "top_k", "64 bits"),
        # Nesting deeper than any OpenAI body: the path to the first too-deep value.
        (
            b'{"prompt": "hi", "logit_bias": ' + nested(40).encode() + b"}",
            "logit_bias" + "[0]" * 15,
            "deeper",
        ),
        # Deeper than Python's own parser recurses (was a RecursionError and a 500).
        (b'{"prompt": ' + nested(2000).encode() + b"}", None, "deeper"),
        (b'{"\\ud800": 1, "prompt": "hi"}', None, "surrogate"),
    ],
)
def test_hostile_json_gets_400_naming_the_field(
    cluster: Cluster, data: bytes, param: str | None, words: str
) -> None:
    r = requests.post(f"{cluster.url}/v1/completions", data=data)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and words in r.json()["error"]["message"]
    assert len(r.text) < 1000  # the echoed value is cut short
    assert_still_serves(cluster)


def test_unknown_route_is_json_404(cluster: Cluster) -> None:
    r = requests.get(f"{cluster.url}/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"


def test_server_still_serves_after_bad_input(cluster: Cluster) -> None:
    for body in ({"prompt": 5}, {"prompt": "hi", "top_p": 9}):
        assert requests.post(f"{cluster.url}/v1/completions", json=body).status_code == 400
    r = requests.post(f"{cluster.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Hi "
    assert cluster.app_state.num_pending == 0
    assert cluster.app_state.metrics.requests["invalid"] >= 2


def test_chat_default_max_tokens_is_clipped_to_the_context(cluster: Cluster) -> None:
    r = requests.post(f"{cluster.url}/v1/chat/completions", json={"messages": MSGS})
    assert r.status_code == 200, r.text  # prompt 21 tokens + default never over 32
    assert r.json()["usage"]["total_tokens"] <= 32
