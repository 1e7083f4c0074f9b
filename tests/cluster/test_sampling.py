"""Sampling features end to end: a 1P1D cluster answers penalized, biased, seeded requests
with logprobs exactly as a collocated worker does (the prefill worker samples the first
token and reports its logprobs, the decode worker the rest), and the official `openai`
client parses the logprobs, streamed and whole."""

from __future__ import annotations

import math

import pytest

from tests.cluster.conftest import post, role, start

openai = pytest.importorskip("openai")

PROCESSING = {
    "presence_penalty": 0.5,
    "frequency_penalty": 0.3,
    "repetition_penalty": 1.3,
    "logit_bias": {"50": 5.0, "60": -100},
    "min_tokens": 4,
}
SEEDED = {"temperature": 0.8, "seed": 11}
GREEDY = {"temperature": 0}


def bodies(model: str) -> list[tuple[str, dict]]:
    chat = {"model": model, "messages": [{"role": "user", "content": "tell me more"}]}
    text = {"model": model, "prompt": [70 + i % 30 for i in range(37)]}
    out = []
    for sampling in (GREEDY, SEEDED):
        out.append(("/v1/completions", {**text, **sampling, **PROCESSING, "logprobs": 3}))
        out.append(
            ("/v1/chat/completions", {**chat, **sampling, **PROCESSING, "logprobs": True,
                                      "top_logprobs": 2})
        )  # fmt: skip
    return [(path, {**body, "max_tokens": 10, "ignore_eos": True}) for path, body in out]


def answers(url: str, model: str) -> list[tuple[str, list[float], list[str]]]:
    out = []
    for path, body in bodies(model):
        choice = post(url, path, body)["choices"][0]
        if "text" in choice:
            lp = choice["logprobs"]
            out.append((choice["text"], lp["token_logprobs"], lp["tokens"]))
        else:
            content = choice["logprobs"]["content"]
            tokens = [c["token"] for c in content]
            out.append((choice["message"]["content"], [c["logprob"] for c in content], tokens))
    return out


@pytest.fixture(scope="module")
def collocated(tiny_served_model):
    with start(tiny_served_model, collocated=role()) as url:
        yield url, answers(url, str(tiny_served_model))


def test_1p1d_equals_collocated_with_penalties_and_logprobs(tiny_served_model, collocated):
    _, reference = collocated
    for text, logprobs, tokens in reference:
        assert len(logprobs) == len(tokens) == 10 and text
        assert all(value <= 0 for value in logprobs)
    with start(tiny_served_model, prefill=role(), decode=role()) as url:
        got = answers(url, str(tiny_served_model))
    assert [(t, k) for t, _, k in got] == [(t, k) for t, _, k in reference]
    for (_, mine, _), (_, theirs, _) in zip(got, reference):
        # The first token's logprob comes from the prefill worker's kernels: same values
        # within float rounding, not necessarily bit for bit.
        assert mine == pytest.approx(theirs, abs=1e-4)


def test_openai_client_parses_logprobs(tiny_served_model, collocated):
    url, _ = collocated
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    model = str(tiny_served_model)
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=3,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and len(content[0].top_logprobs) == 3
    # Raw logprobs, greedy and unprocessed: the sampled token is the likeliest one.
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)
    assert sum(math.exp(t.logprob) for t in content[0].top_logprobs) <= 1 + 1e-5
    assert bytes(content[0].bytes).decode() == content[0].token
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=1, stream=True,
    )  # fmt: skip
    streamed = [t for c in stream if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]  # fmt: skip
    assert [t.token for t in streamed] == [t.token for t in content]
    completion = client.completions.create(model=model, prompt="hello", max_tokens=5,
                                           temperature=0, logprobs=2)  # fmt: skip
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 5
    assert lp.text_offset[0] == 0 and all(len(top) <= 2 for top in lp.top_logprobs)
    chunks = client.completions.create(model=model, prompt="hello", max_tokens=5,
                                       temperature=0, logprobs=2, stream=True)  # fmt: skip
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.tokens]  # fmt: skip
    assert tokens == lp.tokens


def test_logprobs_beyond_the_limit_are_refused(collocated, tiny_served_model):
    url, _ = collocated
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    with pytest.raises(openai.BadRequestError, match="top_logprobs must be in"):
        client.chat.completions.create(
            model=str(tiny_served_model), messages=[{"role": "user", "content": "hi"}],
            logprobs=True, top_logprobs=21,
        )  # fmt: skip
