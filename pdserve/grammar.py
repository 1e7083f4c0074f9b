"""Grammars for structured outputs, as llguidance defines them: built and checked without torch.

A request's constraint (a JSON schema, any JSON object, a regex, a list of choices, a Lark or
GBNF grammar) becomes one string, llguidance's serialized grammar, carried in
`SamplingParams.grammar` to every worker that samples for the request. The router builds and
validates it here (a grammar llguidance rejects is a 400 before any worker hears of it); the
engine compiles it against the model's tokenizer (`pdserve/engine/grammar.py`). Both sides use
the same library, so what the router accepts the worker can run.

Why llguidance over xgrammar (`benchmarks/openai_features.py mask`, docs/structured-outputs.md):
xgrammar's mask is faster per token (7-12 us against 19-29 us at a 49,152 vocabulary), but
both are under 0.2% of a decode step here, and xgrammar imports torch (the router could not
validate with it) and pulls triton (a 286 MB wheel) into a CPU install.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import llguidance

# The kinds a request may ask for, by the name vLLM's `structured_outputs` gives them.
KINDS = ("json", "json_object", "regex", "choice", "grammar")
_ANY_JSON_OBJECT = {"type": "object"}
# JSON as `json.dumps` writes it (", " and ": ", no other whitespace): the form models learn,
# and a model free to add whitespace can spend its whole token budget on it (a sampled model
# did, in runs of tabs). A schema's own "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """The constraint is not one llguidance can run; the message says why."""


def grammar_of(kind: str, value: Any) -> str:
    """llguidance's grammar for one constraint: `json` (a JSON schema, dict or string),
    `json_object` (any JSON object; value ignored), `regex` (a string), `choice` (a list of
    strings), `grammar` (Lark or GBNF text). GrammarError when it cannot be built or run."""
    if kind not in KINDS:
        raise GrammarError(f"unknown constraint kind {kind!r}; one of {KINDS}")
    if isinstance(value, dict) and kind == "json":
        value = json.dumps(value)  # key order kept: properties are written in schema order
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise GrammarError("choice must be a non-empty list of strings")
        value = json.dumps(value)
    elif kind != "json_object" and not isinstance(value, str):
        raise GrammarError(f"{kind} must be a {'JSON schema' if kind == 'json' else 'string'}")
    return _checked(kind, value if kind != "json_object" else "")


@functools.lru_cache(maxsize=256)  # schemas repeat: a service sends the same one each time
def _checked(kind: str, text: str) -> str:
    try:
        if kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                _ANY_JSON_OBJECT, defaults=JSON_OPTIONS
            )
        elif kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        else:
            grammar = llguidance.grammar_from(kind, text)  # "grammar": Lark or llama.cpp's GBNF
    except ValueError as exc:
        raise GrammarError(str(exc)) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise GrammarError(error)
    return grammar
