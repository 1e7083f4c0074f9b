"""Structured-output fields: one llguidance grammar in the request's sampling, or a 400
naming the field before any worker hears of the request."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.grammar import grammar_of
from pdserve.router.config import RouterConfig
from pdserve.router.protocol import ApiError, parse_request

CONFIG = RouterConfig(model="m")
MSGS = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def parse(**fields: Any):
    return parse_request({"messages": MSGS, **fields}, chat=True, config=CONFIG)


def refused(**fields: Any) -> str:
    with pytest.raises(ApiError) as info:
        parse(**fields)
    assert info.value.status == 400
    return info.value.param


def test_text_response_format_is_no_constraint() -> None:
    assert "grammar" not in parse(response_format={"type": "text"}).sampling
    assert "grammar" not in parse(response_format=None).sampling


@pytest.mark.parametrize(
    ("fields", "kind", "value"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", None),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a_1", "schema": SCHEMA, "strict": True},
                }
            },
            "json",
            SCHEMA,
        ),
        ({"guided_json": SCHEMA}, "json", SCHEMA),
        ({"guided_regex": "[0-9]{3}"}, "regex", "[0-9]{3}"),
        ({"guided_choice": ["yes", "no"]}, "choice", ["yes", "no"]),
        ({"guided_grammar": 'start: "a"+'}, "grammar", 'start: "a"+'),
        ({"structured_outputs": {"json": SCHEMA}}, "json", SCHEMA),
        ({"structured_outputs": {"regex": "x+"}}, "regex", "x+"),
        ({"structured_outputs": {"choice": ["a"]}}, "choice", ["a"]),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "grammar", 'root ::= "a"'),
        ({"structured_outputs": {"json_object": True}}, "json_object", None),
    ],
)
def test_each_constraint_becomes_its_grammar(fields: dict, kind: str, value: Any) -> None:
    assert parse(**fields).sampling["grammar"] == grammar_of(kind, value)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            "response_format",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": {"type": "nope"}},
                }
            },
            "response_format",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": SCHEMA, "strict": "yes"},
                }
            },
            "response_format",
        ),
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": "yes"}, "guided_choice"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        ({"guided_json": 5}, "guided_json"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
        ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
        ({"structured_outputs": [1]}, "structured_outputs"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ],
)
def test_bad_constraints_are_refused_by_name(fields: dict, param: str) -> None:
    assert refused(**fields) == param
