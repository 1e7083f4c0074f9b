"""Structured-output fields of an OpenAI body -> the request's grammar, or a 400 naming the field.

`response_format` (OpenAI: `text`, `json_object`, `json_schema`) and vLLM's extensions
(`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, and the newer
`structured_outputs: {json, regex, choice, grammar, json_object}`) become one llguidance grammar
(`grammar_of()` in pdserve/grammar.py), built and validated here, so a schema the library
rejects is a 400 before any worker hears of the request. Nothing is silently ignored: vLLM
fields llguidance cannot honour here (`structural_tag`, `guided_whitespace_pattern`,
`guided_decoding_backend`) are refused by name, and so is a second constraint beside a first.
"""

from __future__ import annotations

import re
from typing import Any

from pdserve.grammar import GrammarError, grammar_of


class FieldError(ValueError):
    """A request field that cannot be honoured; `param` names it (the API's 400)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_REFUSED = ("guided_whitespace_pattern", "guided_decoding_backend", "structural_tag")
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def parse_structured(body: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams kwargs for the body's output constraint: {"grammar": ...} or {}."""
    for name in _REFUSED:
        if body.get(name) is not None:
            raise FieldError(name, f"{name} is not supported here")
    constraints = list(_constraints(body))
    if not constraints:
        return {}
    if len(constraints) > 1:
        first, second = constraints[0][0], constraints[1][0]
        raise FieldError(second, f"{second} cannot be combined with {first}: one constraint")
    param, kind, value = constraints[0]
    return {"grammar": compile_constraint(param, kind, value)}


def compile_constraint(param: str, kind: str, value: Any) -> str:
    """llguidance's grammar for one constraint, or a FieldError naming `param`."""
    try:
        return grammar_of(kind, value)
    except GrammarError as exc:
        raise FieldError(param, f"{param}: {exc}") from None


def _constraints(body: dict[str, Any]):
    """(param, kind, value) for each constraint the body asks for, in a fixed order."""
    fmt = body.get("response_format")
    if fmt is not None:
        found = _response_format(fmt)
        if found is not None:
            yield found
    for name, kind in _GUIDED.items():
        if body.get(name) is not None:
            yield name, kind, body[name]
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise FieldError("structured_outputs", "structured_outputs must be an object")
        for key, value in outputs.items():
            param = f"structured_outputs.{key}"
            if key not in _STRUCTURED_KEYS:
                raise FieldError(param, f"{param} is not supported; one of {_STRUCTURED_KEYS}")
            if value is None or (key == "json_object" and value is False):
                continue
            if key == "json_object" and value is not True:
                raise FieldError(param, f"{param} must be a boolean")
            yield param, key, value


def _response_format(fmt: Any) -> tuple[str, str, Any] | None:
    param = "response_format"
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return param, "json_object", None
    if kind != "json_schema":
        message = "response_format must be {type: text}, {type: json_object} or {type: json_schema}"
        raise FieldError(param, message)
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise FieldError(param, "response_format.json_schema must be an object")
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        message = "response_format.json_schema.name must be 1-64 letters, digits, _ or -"
        raise FieldError(param, message)
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise FieldError(param, "response_format.json_schema.strict must be a boolean")
    schema = spec.get("schema")
    if schema is None:  # OpenAI: optional; then any JSON object
        return param, "json_object", None
    if not isinstance(schema, dict):
        raise FieldError(param, "response_format.json_schema.schema must be an object")
    return param, "json", schema
