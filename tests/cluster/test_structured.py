"""Structured outputs and tool calls end to end: a 1P1D cluster answers JSON-schema and
required-tool requests exactly as a collocated worker does (the prefill worker samples the
first token under the grammar, the decode worker replays it and goes on), and the official
`openai` client parses the typed tool calls, whole and streamed."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.cluster.conftest import post, role, start
from tests.conftest import make_tiny_llama
from tests.router.harness import write_tiny_tokenizer

openai = pytest.importorskip("openai")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"enum": ["Paris", "Oslo", "Lima"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": NO_ARGUMENTS}},
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def bodies(model: str) -> list[dict]:
    out = []
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 5}):
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
        out.append({"response_format": fmt, **sampling})
        out.append({"tools": TOOLS, "tool_choice": "required", **sampling})
    return [{"model": model, "messages": MESSAGES, "max_tokens": 120, **b} for b in out]


def answers(url: str, model: str) -> list[dict]:
    return [post(url, "/v1/chat/completions", body)["choices"][0] for body in bodies(model)]


def without_ids(choice: dict) -> dict:
    for call in choice["message"].get("tool_calls") or []:
        call.pop("id")
    return choice


@pytest.fixture(scope="module")
def tiny_served_model(tmp_path_factory):
    """The served tiny model with room for the tools' prompt: one byte a token, the injected
    tool list alone is ~800 tokens."""
    path = make_tiny_llama(
        tmp_path_factory.mktemp("served_tools"),
        vocab_size=320,
        eos_token_id=2,
        max_position_embeddings=2048,
    )
    return write_tiny_tokenizer(path)


@pytest.fixture(scope="module")
def collocated(tiny_served_model):
    with start(tiny_served_model, collocated=role()) as url:
        yield url, answers(url, str(tiny_served_model))


def test_outputs_follow_the_schema_and_the_tools(collocated):
    _, reference = collocated
    for choice in reference[0::2]:  # JSON schema
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    for choice in reference[1::2]:  # required tool call
        assert choice["finish_reason"] == "tool_calls", choice
        for call in choice["message"]["tool_calls"]:
            function = call["function"]
            tool = next(t for t in TOOLS if t["function"]["name"] == function["name"])
            jsonschema.validate(json.loads(function["arguments"]), tool["function"]["parameters"])


def test_1p1d_equals_collocated(tiny_served_model, collocated):
    _, reference = collocated
    with start(tiny_served_model, prefill=role(), decode=role()) as url:
        got = answers(url, str(tiny_served_model))
    assert [without_ids(c) for c in got] == [without_ids(c) for c in reference]


def test_openai_client_parses_tool_calls_whole_and_streamed(tiny_served_model, collocated):
    url, _ = collocated
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    kwargs = dict(
        model=str(tiny_served_model),
        messages=MESSAGES,
        tools=TOOLS,
        temperature=0,
        max_tokens=120,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    whole = client.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo", "Lima")
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        for entry in delta.tool_calls or []:
            got = calls.setdefault(entry.index, {"id": None, "name": "", "arguments": ""})
            got["id"] = entry.id or got["id"]
            got["name"] += entry.function.name or ""
            got["arguments"] += entry.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    expected = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == expected
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_openai_client_gets_json_for_a_schema(tiny_served_model, collocated):
    url, _ = collocated
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    chat = client.chat.completions.create(
        model=str(tiny_served_model),
        messages=MESSAGES,
        response_format=fmt,
        seed=3,
        max_tokens=120,
    )
    jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(
            model=str(tiny_served_model),
            messages=MESSAGES,
            max_tokens=5,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nope"}},
            },
        )
