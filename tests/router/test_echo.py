"""Completions' `echo` at the router: the prompt's text before the completion (streamed, in
the first chunk), `max_tokens: 0` answering the prompt alone, and the bound on the prompt
scores' message (router/echo.py)."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest
import requests

from pdserve.router.echo import ALTERNATIVE_BYTES, ENTRY_BYTES, check_size
from pdserve.router.protocol import ApiError
from tests.router.harness import Cluster


@pytest.fixture(scope="module")
def cluster(tokenizer_dir: Path, script: list[int]):
    with Cluster(tokenizer_dir, script, {"p0": "prefill", "d0": "decode"}) as c:
        yield c


def test_echo_puts_the_prompt_before_the_completion(cluster: Cluster) -> None:
    body = {"prompt": "Say: ", "max_tokens": 3, "echo": True}
    r = requests.post(f"{cluster.url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "Say: Hi "
    r = requests.post(f"{cluster.url}/v1/completions", json={**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line[6:7] == "{"]
    assert chunks[0]["choices"][0]["text"] == "Say: H"  # the prompt and the first token
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Say: Hi "


def test_every_choice_starts_with_the_prompt(cluster: Cluster) -> None:
    body = {"prompt": "Say: ", "max_tokens": 3, "echo": True, "n": 2}
    choices = requests.post(f"{cluster.url}/v1/completions", json=body).json()["choices"]
    assert [c["text"] for c in choices] == ["Say: Hi "] * 2
    body = {**body, "max_tokens": 0, "best_of": 3}
    choices = requests.post(f"{cluster.url}/v1/completions", json=body).json()["choices"]
    assert [c["text"] for c in choices] == ["Say: "] * 2


def test_max_tokens_zero_answers_the_prompt_alone(cluster: Cluster) -> None:
    body = {"prompt": "Say: ", "max_tokens": 0, "echo": True}
    answer = requests.post(f"{cluster.url}/v1/completions", json=body).json()
    assert answer["choices"][0]["text"] == "Say: "
    assert answer["choices"][0]["finish_reason"] == "length"
    r = requests.post(f"{cluster.url}/v1/completions", json={**body, "echo": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("num_top", [0, 1, 15, 16, 20])
def test_the_size_bound_holds_the_worst_scores(num_top: int) -> None:
    """The largest token id and float64 values: the packed scores stay within the bound."""
    entry = [-1.234567890123, [[2**32 - 1, -9.87654321012345]] * num_top]
    assert len(msgpack.packb(entry)) <= ENTRY_BYTES + ALTERNATIVE_BYTES * num_top


def test_scores_that_cannot_fit_one_message_are_a_400_naming_logprobs() -> None:
    check_size(8192, 20, 16 * 2**20)  # the default model's context, the most alternatives
    check_size(10**7, None, 16 * 2**20)  # no scores asked: no bound
    with pytest.raises(ApiError, match="max_tokens|max_message_bytes") as error:
        check_size(60_000, 20, 16 * 2**20)
    assert error.value.status == 400 and error.value.param == "logprobs"
