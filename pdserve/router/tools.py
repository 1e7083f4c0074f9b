"""Tool calling: `tools`, `tool_choice` and `parallel_tool_calls` in; `tool_calls` out.

The model family's chat format decides three things (`tool_format()`, from its template):

- `hermes`: a template that renders tools itself and asks for `<tool_call>{json}</tool_call>`
  (Qwen2.5, Hermes); tools and tool messages go to the template.
- `llama3_json`: a Llama 3.1/3.2 template (`<|python_tag|>`, `Environment: ipython`): the
  template renders the tools, the model answers `{"name": ..., "parameters": {...}}`.
- `injected`: a template that knows nothing of tools (SmolLM2's, the default model): the tools
  go into the system message in the Hermes wording and the model is asked for Hermes calls;
  an assistant's earlier calls and the tool results are written into the messages as text.

`tool_choice` "required" or a named function is enforced by a grammar (pdserve/grammar.py):
the output can only be calls in the family's format. "auto" leaves the model free and parses
what it wrote; "none" neither renders the tools nor parses. Output that looks like a call but
does not parse (bad JSON, an unknown name) stays text and is counted
(`pdserve_tool_call_parse_failures_total`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, replace
from typing import Any

from pdserve.grammar import JSON_OPTIONS
from pdserve.router.structured import FieldError, compile_constraint

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_INJECTED_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass(frozen=True)
class ToolSpec:
    """A request's validated tools and how it wants them used."""

    tools: tuple[dict[str, Any], ...]  # {"type": "function", "function": {name, ...}}
    choice: str  # "auto", "none", "required" or "named"
    name: str | None = None  # the named function
    parallel: bool = True
    format: str = "injected"  # set from the tokenizer's template by `attach()`

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    @property
    def parses(self) -> bool:
        return self.choice != "none"


def parse_tools(body: dict[str, Any]) -> ToolSpec | None:
    """The body's tool fields, checked (FieldError naming the field), or None without tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise FieldError("parallel_tool_calls", "parallel_tool_calls must be a boolean")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise FieldError("tool_choice", "tool_choice needs tools")
        return None
    if not isinstance(tools, list):
        raise FieldError("tools", "tools must be a list of {type: function, function: {...}}")
    checked = tuple(_check_tool(index, tool) for index, tool in enumerate(tools))
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) < len(names):
        raise FieldError("tools", "tools name a function twice")
    name = None
    if choice is None or choice in ("auto", "none", "required"):
        choice = choice or "auto"
    elif isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if name not in names:
            raise FieldError("tool_choice", f"tool_choice names an unknown function {name!r}")
        choice = "named"
    else:
        message = 'tool_choice must be "auto", "none", "required" or {type: function, ...}'
        raise FieldError("tool_choice", message)
    return ToolSpec(checked, choice, name, parallel is not False)


def _check_tool(index: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise FieldError("tools", f"{where} must be {{type: function, function: {{...}}}}")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise FieldError("tools", f"{where}.function must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise FieldError("tools", f"{where}.function.name must be 1-64 letters, digits, _ or -")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise FieldError("tools", f"{where}.function.description must be a string")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise FieldError("tools", f"{where}.function.parameters must be an object (JSON schema)")
    kept = {k: v for k, v in function.items() if k in ("name", "description", "parameters")}
    return {"type": "function", "function": kept}


def tool_format(chat_template: str | None) -> str:
    """The family's tool-call format, read from its chat template."""
    template = chat_template or ""
    if "tools" in template and CALL_OPEN in template:
        return "hermes"
    if "tools" in template and ("<|python_tag|>" in template or "Environment: ipython" in template):
        return "llama3_json"
    return "injected"


def attach(spec: ToolSpec, chat_template: str | None, sampling: dict[str, Any]) -> ToolSpec:
    """`spec` in the family's format; for "required" or a named function, the grammar that
    allows only calls goes into `sampling` (a 400 naming `tool_choice` beside another
    constraint, or naming `tools` when a tool's parameters are not a schema llguidance
    can run)."""
    spec = replace(spec, format=tool_format(chat_template))
    if spec.choice not in ("required", "named"):
        return spec
    if "grammar" in sampling:
        raise FieldError("tool_choice", "tool_choice cannot be combined with response_format")
    functions = [t["function"] for t in spec.tools]
    chosen = [f for f in functions if spec.choice == "required" or f["name"] == spec.name]
    key = "parameters" if spec.format == "llama3_json" else "arguments"
    schema = {
        "x-guidance": JSON_OPTIONS,  # inside a tool grammar too
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f["name"]},
                    key: f.get("parameters") or {"type": "object"},
                },
                "required": ["name", key],
                "additionalProperties": False,
            }
            for f in chosen
        ],
    }
    if spec.format == "llama3_json":
        call, separator = f"%json {json.dumps(schema)}", '"; "'
    else:
        call, separator = f'"<tool_call>\\n" %json {json.dumps(schema)} "\\n</tool_call>"', '"\\n"'
    more = f" ({separator} call)*" if spec.parallel else ""
    lark = f"start: call{more}\ncall: {call}\n"
    sampling["grammar"] = compile_constraint("tools", "grammar", lark)
    return spec


def chat_input(
    spec: ToolSpec | None, messages: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages to render and the tools to hand the template (None: it gets none)."""
    if spec is None or spec.format == "injected":
        messages = [_as_text(m) for m in messages]
        if spec is None or not spec.parses:
            return messages, None
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in spec.tools)
        prompt = _INJECTED_PROMPT.format(tools=listed)
        if messages[0].get("role") == "system":
            first = messages[0]
            return [{**first, "content": f"{first['content']}\n\n{prompt}"}, *messages[1:]], None
        return [{"role": "system", "content": prompt}, *messages], None
    return [_for_template(m) for m in messages], list(spec.tools) if spec.parses else None


def _as_text(message: dict[str, Any]) -> dict[str, Any]:
    """A message with tool calls or a tool result, written as Hermes text."""
    calls, content = message.get("tool_calls"), message.get("content")
    if message.get("role") == "tool" and isinstance(content, str):
        return {"role": "tool", "content": f"<tool_response>\n{content}\n</tool_response>"}
    if not isinstance(calls, list) or not calls:
        return message
    text = [content or ""]
    for call in map(_arguments_as_object, calls):
        function = call.get("function", {}) if isinstance(call, dict) else {}
        call_json = json.dumps(
            {"name": function.get("name"), "arguments": function.get("arguments")}
        )
        text.append(f"{CALL_OPEN}\n{call_json}\n{CALL_CLOSE}")
    return {"role": message["role"], "content": "\n".join(t for t in text if t)}


def _for_template(message: dict[str, Any]) -> dict[str, Any]:
    """A message for a template that renders tool calls: arguments as objects (templates
    write them with `tojson`), no null content."""
    message = {**message, "content": message.get("content") or ""}
    if isinstance(message.get("tool_calls"), list):
        message["tool_calls"] = [_arguments_as_object(c) for c in message["tool_calls"]]
    return message


def _arguments_as_object(call: Any) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    function = call["function"]
    return {**call, "function": {**function, "arguments": _loads(function.get("arguments"))}}


def _loads(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def parse_calls(text: str, spec: ToolSpec) -> tuple[str | None, list[dict[str, Any]], int]:
    """(content left, OpenAI tool_calls, calls that failed to parse) of a whole output."""
    calls: list[dict[str, Any]] = []
    if spec.format == "llama3_json":
        pieces = [p for p in text.strip().split("; ")] if text.strip().startswith("{") else []
        parsed = [_call(p, spec, "parameters") for p in pieces]
        if pieces and all(parsed):
            return None, [c for c in parsed if c], 0
        return text or None, [], int(bool(pieces))
    failed, kept, start = 0, [], 0
    for match in _CALL.finditer(text):
        call = _call(match.group(1), spec, "arguments")
        if call is None:
            failed += 1
            continue
        calls.append(call)
        kept.append(text[start : match.start()])
        start = match.end()
    content = ("".join(kept) + text[start:]).strip()
    if calls and spec.choice in ("required", "named"):
        content = ""  # all calls by grammar: what is left is a call cut short by max_tokens
    return content or None, calls, failed


def _call(text: str, spec: ToolSpec, key: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in spec.names:
        return None
    arguments = value.get(key, value.get("arguments", value.get("parameters", {})))
    if not isinstance(arguments, dict):
        return None
    function = {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}


def finish_reason(reason: str | None, calls: list[dict[str, Any]]) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason
