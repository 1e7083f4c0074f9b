"""The OpenAI API over a fake collocated worker: shapes, streaming, stop strings, aborts."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import requests

from tests.router.conftest import OUTPUT_TEXT
from tests.router.harness import Cluster


@pytest.fixture(scope="module")
def cluster(tokenizer_dir: Path, script: list[int]):
    with Cluster(tokenizer_dir, script, {"c0": "collocated"}) as c:
        yield c


def sse_events(response: requests.Response) -> list:
    lines = [line for line in response.iter_lines(decode_unicode=True) if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_completion_has_openai_shape_and_usage(cluster: Cluster) -> None:
    r = requests.post(f"{cluster.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == "tiny" and isinstance(body["created"], int)
    assert body["choices"] == [
        {"index": 0, "text": OUTPUT_TEXT[:5], "logprobs": None, "finish_reason": "length"}
    ]
    assert body["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 5,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_completion_runs_to_eos_and_accepts_token_ids(cluster: Cluster) -> None:
    r = requests.post(
        f"{cluster.url}/v1/completions", json={"prompt": [[72, 73]], "max_tokens": 100}
    )
    body = r.json()
    assert body["choices"][0]["text"] == OUTPUT_TEXT
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len(OUTPUT_TEXT) + 1  # EOS counts


def test_streaming_completion_with_usage(cluster: Cluster) -> None:
    r = requests.post(
        f"{cluster.url}/v1/completions",
        json={
            "prompt": "Hi",
            "max_tokens": 8,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        stream=True,
    )
    assert r.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(r)
    *chunks, usage = events
    assert len({e["id"] for e in events}) == 1 and chunks[0]["object"] == "text_completion"
    assert "".join(c["choices"][0]["text"] for c in chunks) == OUTPUT_TEXT[:8]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 2 + 8


def test_chat_completion(cluster: Cluster, tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    r = requests.post(f"{cluster.url}/v1/chat/completions", json={"messages": messages})
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": OUTPUT_TEXT}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["prompt_tokens"] == len(tokenizer.apply_chat_template(messages))
    assert body["usage"]["completion_tokens"] == len(OUTPUT_TEXT) + 1


def test_openai_client_streams_chat(cluster: Cluster) -> None:
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused")
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == OUTPUT_TEXT[:6]
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 6
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_stop_string_ends_request_and_aborts_worker(cluster: Cluster) -> None:
    r = requests.post(
        f"{cluster.url}/v1/completions", json={"prompt": "x", "max_tokens": 100, "stop": ["How"]}
    )
    body = r.json()
    assert body["choices"][0]["text"] == "Hi there! "
    assert body["choices"][0]["finish_reason"] == "stop"
    cluster.wait_until(lambda: cluster.workers["c0"].aborted)


def test_client_disconnect_aborts_worker(tokenizer_dir: Path, script: list[int]) -> None:
    with Cluster(tokenizer_dir, script, {"c0": "collocated"}, {"c0": {"step_s": 0.2}}) as c:
        r = requests.post(
            f"{c.url}/v1/completions",
            json={"prompt": "x", "max_tokens": 50, "stream": True},
            stream=True,
        )
        next(r.iter_lines(chunk_size=1))  # the first token arrived: the request is decoding
        r.close()
        c.wait_until(lambda: c.workers["c0"].aborted)
        c.wait_until(lambda: c.app_state.metrics.requests["cancelled"] == 1)
        assert c.app_state.num_pending == 0


def test_penalties_bias_and_min_tokens_reach_the_worker(cluster: Cluster) -> None:
    fields = {
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "repetition_penalty": 1.2,
        "min_tokens": 2,
        "logit_bias": {"72": -100, "5": 3.5},
    }
    body = {"prompt": "Hello", "max_tokens": 3, **fields}
    r = requests.post(f"{cluster.url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    sent = [m for m in cluster.workers["c0"].received if hasattr(m, "sampling")][-1].sampling
    assert {k: sent[k] for k in fields if k != "logit_bias"} == {
        k: v for k, v in fields.items() if k != "logit_bias"
    }
    assert [list(pair) for pair in sent["logit_bias"]] == [[72, -100.0], [5, 3.5]]
