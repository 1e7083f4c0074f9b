"""Sampling features end to end: a 1P1D cluster answers penalized, biased, seeded requests
with logprobs exactly as a collocated worker does (the prefill worker samples the first
token and reports its logprobs, the decode worker the rest), and the official `openai`
client parses the logprobs, streamed and whole."""

from __future__ import annotations

import math
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.cluster.conftest import get_text, post, role, start

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
            (
                "/v1/chat/completions",
                {**chat, **sampling, **PROCESSING, "logprobs": True, "top_logprobs": 2},
            )
        )
    out.append(("/v1/completions", {**text, **SEEDED, **PROCESSING, "logprobs": 1, "n": 3}))
    out.append(("/v1/chat/completions", {**chat, **SEEDED, "logprobs": True, "n": 2}))
    return [(path, {**body, "max_tokens": 10, "ignore_eos": True}) for path, body in out]


def answers(url: str, model: str) -> list[tuple[str, list[float], list[str]]]:
    out = []
    for path, body in bodies(model):
        choices = post(url, path, body)["choices"]
        assert [c["index"] for c in choices] == list(range(body.get("n", 1)))
        for choice in choices:
            out.append(_answer(choice))
    return out


def _answer(choice: dict) -> tuple[str, list[float], list[str]]:
    if "text" in choice:
        lp = choice["logprobs"]
        return choice["text"], lp["token_logprobs"], lp["tokens"]
    content = choice["logprobs"]["content"]
    tokens = [c["token"] for c in content]
    return choice["message"]["content"], [c["logprob"] for c in content], tokens


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
        model=model,
        messages=messages,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and len(content[0].top_logprobs) == 3
    # Raw logprobs, greedy and unprocessed: the sampled token is the likeliest one.
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)
    assert sum(math.exp(t.logprob) for t in content[0].top_logprobs) <= 1 + 1e-5
    assert bytes(content[0].bytes).decode() == content[0].token
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=1,
        stream=True,
    )
    streamed = [
        t
        for c in stream
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert [t.token for t in streamed] == [t.token for t in content]
    completion = client.completions.create(
        model=model, prompt="hello", max_tokens=5, temperature=0, logprobs=2
    )
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 5
    assert lp.text_offset[0] == 0 and all(len(top) <= 2 for top in lp.top_logprobs)
    chunks = client.completions.create(
        model=model, prompt="hello", max_tokens=5, temperature=0, logprobs=2, stream=True
    )
    tokens = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens
    ]
    assert tokens == lp.tokens


def test_logprobs_beyond_the_limit_are_refused(collocated, tiny_served_model):
    url, _ = collocated
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    with pytest.raises(openai.BadRequestError, match="top_logprobs must be in"):
        client.chat.completions.create(
            model=str(tiny_served_model),
            messages=[{"role": "user", "content": "hi"}],
            logprobs=True,
            top_logprobs=21,
        )


def computed_prompt_tokens(url: str) -> int:
    """The workers' computed prompt tokens, once their heartbeats stop changing it."""
    pattern = r'pdserve_worker_prompt_tokens_total\{[^}]*source="computed"[^}]*\} (\S+)'
    last, stable = -1, 0
    while stable < 3:
        time.sleep(0.3)
        value = int(sum(float(v) for v in re.findall(pattern, get_text(url, "/metrics"))))
        stable, last = (stable + 1, last) if value == last else (0, value)
    return last


def test_n_shares_one_prefill_and_seeds_each_choice(tiny_served_model, collocated):
    url, _ = collocated
    model = str(tiny_served_model)
    rng = random.Random(5)
    prompt = [rng.randrange(40, 120) for _ in range(150)]
    body = {"model": model, "max_tokens": 6, "ignore_eos": True, **SEEDED}
    before = computed_prompt_tokens(url)
    shared = post(url, "/v1/completions", {**body, "prompt": prompt, "n": 4})
    computed_shared = computed_prompt_tokens(url) - before
    alone = post(url, "/v1/completions", {**body, "prompt": prompt})["choices"][0]["text"]
    texts = [c["text"] for c in shared["choices"]]
    assert texts[0] == alone and len(set(texts)) > 1  # sample i is seeded with seed + i
    assert shared["usage"]["prompt_tokens"] == 150
    assert shared["usage"]["completion_tokens"] == 24
    # The prompt once, and each other sample only the last partial block (16-token blocks).
    assert computed_shared <= 150 + 3 * 16, computed_shared
    # Four separate requests of four prompts, none cached: each computes its prompt whole.
    others = [[rng.randrange(40, 120) for _ in range(150)] for _ in range(4)]
    before = computed_prompt_tokens(url)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda p: post(url, "/v1/completions", {**body, "prompt": p}), others))
    computed_separate = computed_prompt_tokens(url) - before
    assert computed_separate >= 1.5 * computed_shared, (computed_separate, computed_shared)


def test_best_of_returns_the_likeliest_and_the_client_parses_n(tiny_served_model, collocated):
    url, _ = collocated
    model = str(tiny_served_model)
    body = {"model": model, "prompt": "hello", "max_tokens": 5, **SEEDED}
    best = post(url, "/v1/completions", {**body, "best_of": 4, "n": 2, "logprobs": 0})
    scores = [sum(c["logprobs"]["token_logprobs"]) for c in best["choices"]]
    assert len(scores) == 2 and scores[0] >= scores[1]
    everyone = post(url, "/v1/completions", {**body, "n": 4, "logprobs": 0})["choices"]
    top = sorted((sum(c["logprobs"]["token_logprobs"]) for c in everyone), reverse=True)[:2]
    assert scores == pytest.approx(top)  # the same four samples (seeds), the best two
    assert post(url, "/v1/completions", {**body, "best_of": 3})["choices"][0]["logprobs"] is None
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, n=3, seed=3, temperature=1.0
    )
    assert [c.index for c in chat.choices] == [0, 1, 2]
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, n=3, seed=3, temperature=1.0, stream=True
    )
    streamed = ["", "", ""]
    for chunk in stream:
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == [c.message.content for c in chat.choices]
    completion = client.completions.create(
        model=model, prompt="hi", max_tokens=4, n=2, seed=3, temperature=1.0, stream=True
    )
    assert {c.index for chunk in completion for c in chunk.choices} == {0, 1}
    with pytest.raises(openai.BadRequestError, match="best_of > n cannot be streamed"):
        client.completions.create(model=model, prompt="hi", best_of=2, stream=True)
    with pytest.raises(openai.BadRequestError, match="n must be in"):
        client.completions.create(model=model, prompt="hi", n=17)


def echo_answers(url: str, model: str) -> tuple[dict, dict]:
    """A 37-token prompt echoed and scored with 4 tokens after it, and with none
    (`max_tokens: 0`: the prompt alone, as evaluation harnesses score one)."""
    body = {
        "model": model,
        "prompt": [70 + i % 30 for i in range(37)],
        "echo": True,
        "logprobs": 2,
        **GREEDY,
    }
    whole = post(url, "/v1/completions", {**body, "max_tokens": 4})["choices"][0]
    only = post(url, "/v1/completions", {**body, "max_tokens": 0})["choices"][0]
    return whole, only


def test_echo_scores_the_prompt_and_1p1d_equals_collocated(tiny_served_model, collocated):
    url, _ = collocated
    model = str(tiny_served_model)
    # The prompt of bodies(): the collocated worker holds its blocks, which echo recomputes.
    whole, only = echo_answers(url, model)
    body = {
        "model": model,
        "prompt": [70 + i % 30 for i in range(37)],
        "max_tokens": 4,
        "logprobs": 2,
        **GREEDY,
    }
    plain = post(url, "/v1/completions", body)["choices"][0]
    lp, lp_only = whole["logprobs"], only["logprobs"]
    assert whole["text"] == only["text"] + plain["text"] and only["finish_reason"] == "length"
    assert len(lp["tokens"]) == 41 and lp["token_logprobs"][0] is None
    # Keyed by token text: two byte tokens that each decode to U+FFFD share one key.
    assert lp["top_logprobs"][0] is None and all(1 <= len(t) <= 2 for t in lp["top_logprobs"][1:])
    assert lp["tokens"][37:] == plain["logprobs"]["tokens"]
    assert lp["token_logprobs"][37:] == pytest.approx(plain["logprobs"]["token_logprobs"])
    assert lp["text_offset"][37] == len(only["text"])  # the completion's offsets follow on
    assert lp_only["tokens"] == lp["tokens"][:37]
    assert lp_only["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:37], abs=1e-5)
    with start(tiny_served_model, prefill=role(), decode=role()) as pd_url:
        # Twice: cold, then with both workers' caches holding the prompt.
        for _ in range(2):
            for mine, theirs in zip(echo_answers(pd_url, model), (whole, only)):
                assert mine["text"] == theirs["text"]
                assert mine["logprobs"]["tokens"] == theirs["logprobs"]["tokens"]
                values = mine["logprobs"]["token_logprobs"]
                expected = theirs["logprobs"]["token_logprobs"]
                assert values[0] is None and values[1:] == pytest.approx(expected[1:], abs=1e-4)


def test_openai_client_parses_an_echo_completion(tiny_served_model, collocated):
    url, _ = collocated
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    model, prompt = str(tiny_served_model), "hello there"
    for max_tokens in (0, 1):
        completion = client.completions.create(
            model=model, prompt=prompt, echo=True, logprobs=2, max_tokens=max_tokens
        )
        choice, num_prompt = completion.choices[0], completion.usage.prompt_tokens
        lp = choice.logprobs
        assert choice.text.startswith(prompt) and (choice.text == prompt) == (max_tokens == 0)
        assert len(lp.tokens) == len(lp.token_logprobs) == num_prompt + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.text_offset[0] == 0 and all(v <= 0 for v in lp.token_logprobs[1:])
    stream = client.completions.create(
        model=model, prompt=prompt, echo=True, logprobs=2, max_tokens=3, temperature=0, stream=True
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    assert chunks[0].text.startswith(prompt)
    assert len(chunks[0].logprobs.tokens) == num_prompt + 1  # the prompt and the first token
    whole = client.completions.create(
        model=model, prompt=prompt, echo=True, logprobs=2, max_tokens=3, temperature=0
    )
    assert "".join(c.text for c in chunks) == whole.choices[0].text
    streamed = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    assert streamed == whole.choices[0].logprobs.tokens
    # n = 2: every choice starts with the prompt and its scores, computed once (by sample 0).
    two = client.completions.create(
        model=model, prompt=prompt, echo=True, logprobs=2, n=2, max_tokens=3, temperature=0
    )
    for choice in two.choices:
        assert choice.text == whole.choices[0].text
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(
            whole.choices[0].logprobs.token_logprobs[1:], abs=1e-5
        )
