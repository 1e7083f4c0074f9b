"""Tool calling on the router: tools checked by name, rendered per family, calls parsed from
whole and streamed output alike, and required calls enforced by a grammar."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import llguidance
import llguidance.hf
import pytest

from pdserve.model.tokenizer import Tokenizer
from pdserve.router.config import RouterConfig
from pdserve.router.protocol import ApiError, parse_request
from pdserve.router.tool_stream import rewrite_body, tool_deltas
from pdserve.router.tools import chat_input, parse_calls, tool_format

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
MSGS = [{"role": "user", "content": "Weather in Paris?"}]
CONFIG = RouterConfig(model="m")
HERMES_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}{{ tools }}<tool_call>"
LLAMA3_TEMPLATE = "{{ tools }} Environment: ipython <|python_tag|>"
TWO_CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def parse(template: str | None = None, **fields: Any):
    return parse_request(
        {"messages": MSGS, **fields}, chat=True, config=CONFIG, chat_template=template
    )


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function", "function": {}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": {"get_weather": {}}}, "tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
def test_bad_tool_fields_are_refused_by_name(fields: dict, param: str) -> None:
    with pytest.raises(ApiError) as info:
        parse(**fields)
    assert info.value.status == 400 and info.value.param == param


def test_tools_on_completions_are_refused() -> None:
    with pytest.raises(ApiError) as info:
        parse_request({"prompt": "hi", "tools": [WEATHER]}, chat=False, config=CONFIG)
    assert info.value.param == "tools"


def test_the_family_format_comes_from_the_template(tokenizer: Tokenizer) -> None:
    assert tool_format(tokenizer.chat_template) == "injected"  # ChatML without tools
    assert tool_format(HERMES_TEMPLATE) == "hermes"
    assert tool_format(LLAMA3_TEMPLATE) == "llama3_json"
    assert parse(tools=[WEATHER]).tools.format == "injected"
    assert parse(HERMES_TEMPLATE, tools=[WEATHER]).tools.format == "hermes"


def test_injected_tools_and_tool_messages_render_as_hermes_text(tokenizer: Tokenizer) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        *MSGS,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    spec = parse(tools=[WEATHER]).tools
    rendered, template_tools = chat_input(spec, messages)
    assert template_tools is None and rendered[0]["role"] == "system"
    assert '"name": "get_weather"' in rendered[0]["content"]
    text = tokenizer.decode(tokenizer.apply_chat_template(rendered), skip_special_tokens=False)
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )
    assert "<tool_response>\nsunny\n</tool_response>" in text
    # tool_choice "none": the tools are not offered.
    assert chat_input(parse(tools=[WEATHER], tool_choice="none").tools, MSGS)[0] == MSGS


def test_a_template_with_tools_gets_them(tokenizer: Tokenizer) -> None:
    spec = parse(HERMES_TEMPLATE, tools=[WEATHER]).tools
    messages, template_tools = chat_input(spec, MSGS)
    assert messages == MSGS and template_tools == [WEATHER]


def test_hermes_calls_are_parsed_and_the_rest_is_content() -> None:
    spec = parse(tools=[WEATHER, TIME]).tools
    text = f"Let me check.\n{TWO_CALLS}"
    content, calls, failed = parse_calls(text, spec)
    assert content == "Let me check." and failed == 0
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    bad = '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>'
    assert parse_calls(bad, spec) == (bad, [], 1)


def test_llama3_json_calls_are_parsed() -> None:
    spec = parse(LLAMA3_TEMPLATE, tools=[WEATHER]).tools
    _, calls, _ = parse_calls('{"name": "get_weather", "parameters": {"city": "Oslo"}}', spec)
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert parse_calls("Plain words.", spec) == ("Plain words.", [], 0)


async def _collect(spec, pieces: list[str], reason: str = "stop") -> list:
    async def deltas():
        for i, piece in enumerate(pieces):
            yield SimpleNamespace(
                text=piece, finish_reason=reason if i == len(pieces) - 1 else None
            )

    return [d async for d in tool_deltas(spec, deltas(), lambda n: None)]


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_streamed_calls_equal_the_whole_response(size: int) -> None:
    spec = parse(tools=[WEATHER, TIME]).tools
    text = f"Sure. {TWO_CALLS}"
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    out = asyncio.run(_collect(spec, pieces))
    content = "".join(d.text for d in out)
    calls: dict[int, dict] = {}
    for d in out:
        for entry in d.tool_calls or []:
            call = calls.setdefault(entry["index"], {"name": "", "arguments": ""})
            call["name"] += entry.get("function", {}).get("name", "")
            call["arguments"] += entry["function"]["arguments"]
            if "id" in entry:
                call["id"] = entry["id"]
    body = {"choices": [{"message": {"content": text}, "finish_reason": "stop"}]}
    rewrite_body(body, spec, lambda n: None)
    whole = body["choices"][0]
    assert content.strip() == whole["message"]["content"] == "Sure."
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]
    ]
    assert out[-1].finish_reason == whole["finish_reason"] == "tool_calls"
    assert all(d.finish_reason is None for d in out[:-1])


def test_plain_text_streams_through_and_a_partial_marker_is_released() -> None:
    spec = parse(tools=[WEATHER]).tools
    out = asyncio.run(_collect(spec, ["Hello <tool", "box> there"]))
    assert "".join(d.text for d in out) == "Hello <toolbox> there"
    assert out[-1].finish_reason == "stop" and not any(d.tool_calls for d in out)


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_required_and_named_choices_are_enforced_by_a_grammar(tokenizer, choice) -> None:
    sampling = parse(tools=[WEATHER, TIME], tool_choice=choice).sampling
    llg = llguidance.hf.from_tokenizer(tokenizer.backend, eos_token=tokenizer.eos_token_ids)

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(llg, sampling["grammar"])
        tokens = tokenizer.encode(text)
        return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()

    time_call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    weather_call = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    assert accepts(time_call)
    assert accepts(weather_call) == (choice == "required")
    assert not accepts("Just text.")
    assert not accepts('<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>')


def test_a_required_call_cut_short_is_not_content() -> None:
    """Under a required choice the grammar allows only calls: a second call that max_tokens
    cut off is dropped, not returned as text beside the first."""
    spec = parse(tools=[WEATHER], tool_choice="required").tools
    first = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls, _ = parse_calls(f"{first}\n{first[:-3]}", spec)
    assert content is None and len(calls) == 1
    out = asyncio.run(_collect(spec, [first, "\n", first[:-3]], reason="length"))
    assert "".join(d.text for d in out) == "" and out[-1].finish_reason == "length"
    assert sum(1 for d in out for e in d.tool_calls or [] if "id" in e) == 1


def test_several_choices_with_tools_are_refused_by_name() -> None:
    with pytest.raises(ApiError) as info:
        parse(tools=[WEATHER], n=2)
    assert info.value.param == "n"
    assert parse(tools=[WEATHER], tool_choice="none", n=2).tools.choice == "none"
