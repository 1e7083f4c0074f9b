"""Every field of the two generation bodies, and what pdserve does with it: implemented,
accepted as metadata that changes nothing in the answer, or refused with a 400 naming it at
any value but the ones that change nothing (docs/configuration.md, "Request fields").

A field in no row is refused too, naming it (with the closest known name): OpenAI answers an
unrecognized argument with a 400, and a typo silently ignored (`temprature`) returns an answer
the client did not ask for; vLLM ignores extra fields with a line in its own log, which the
client never sees. `parse_request()` in pdserve/router/protocol.py consults `check_fields()`
before parsing anything else and answers its refusal as the 400; the implemented fields are
parsed there and in the modules it calls (structured.py, tools.py, scope.py), whose own
refusals stay theirs (structured.py's `_REFUSED`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.router.structured import FieldError
from pdserve.schema import suggest

IMPLEMENTED, METADATA, REFUSED = "implemented", "metadata", "refused"
CHAT, COMPLETIONS, BOTH = "chat", "completions", "both"
_PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions"}
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class Field:
    """`how` pdserve treats the field on `where` (chat, completions or both), and `why`.
    METADATA: any value of type `kind` (or null) is taken and changes nothing. REFUSED: the
    `accepted` values (what the field means when absent) pass, any other is a 400."""

    how: str
    where: str
    why: str
    accepted: tuple[Any, ...] = (None,)
    kind: type | tuple[type, ...] | None = None


def _implemented(where: str, why: str) -> Field:
    return Field(IMPLEMENTED, where, why)


def _metadata(where: str, kind: type | tuple[type, ...], why: str) -> Field:
    return Field(METADATA, where, why, kind=kind)


def _refused(where: str, why: str, *accepted: Any) -> Field:
    return Field(REFUSED, where, why, (None, *accepted))


FIELDS: dict[str, Field] = {
    # ---- OpenAI, both endpoints ---------------------------------------------------------
    "model": _implemented(BOTH, "the served name; another is a 404"),
    "max_tokens": _implemented(BOTH, "clipped to the context when absent"),
    "temperature": _implemented(BOTH, "SamplingParams"),
    "top_p": _implemented(BOTH, "SamplingParams"),
    "seed": _implemented(BOTH, "per-request sampling seed"),
    "stop": _implemented(BOTH, "stop strings, at most max_num_stop"),
    "stream": _implemented(BOTH, "SSE"),
    "stream_options": _implemented(BOTH, "include_usage"),
    "presence_penalty": _implemented(BOTH, "pdserve/model/penalties.py"),
    "frequency_penalty": _implemented(BOTH, "pdserve/model/penalties.py"),
    "logit_bias": _implemented(BOTH, "pdserve/model/penalties.py"),
    "logprobs": _implemented(BOTH, "chat: a boolean; completions: the number of alternatives"),
    "n": _implemented(BOTH, "choices.py: one shared prefill"),
    "response_format": _implemented(BOTH, "structured.py: a grammar"),
    "user": _metadata(BOTH, str, "an end-user id for the provider's abuse checks; none here"),
    # ---- OpenAI, chat only ----------------------------------------------------------------
    "messages": _implemented(CHAT, "the chat template; at most max_messages"),
    "max_completion_tokens": _implemented(CHAT, "max_tokens' newer name"),
    "top_logprobs": _implemented(CHAT, "with logprobs: true"),
    "tools": _implemented(CHAT, "tools.py"),
    "tool_choice": _implemented(CHAT, "tools.py"),
    "parallel_tool_calls": _implemented(CHAT, "tools.py"),
    "metadata": _metadata(CHAT, dict, "tags for stored completions; nothing is stored"),
    "safety_identifier": _metadata(CHAT, str, "like user: a hashed end-user id"),
    "prompt_cache_key": _metadata(
        CHAT, str, "a routing hint for cache hits; the router routes by the prompt's blocks"
    ),
    "prediction": _metadata(
        CHAT, dict, "predicted output: a latency hint, the answer is the same without it"
    ),
    "store": _refused(CHAT, "nothing is stored for distillation or evals", False),
    "service_tier": _refused(CHAT, "one tier here", "auto", "default"),
    "prompt_cache_retention": _refused(CHAT, "the cache holds what fits", "in_memory"),
    "modalities": _refused(CHAT, "text only", ["text"]),
    "audio": _refused(CHAT, "no audio output"),
    "reasoning_effort": _refused(CHAT, "no reasoning-effort control in the template"),
    "verbosity": _refused(CHAT, "no verbosity control"),
    "web_search_options": _refused(CHAT, "no web search"),
    "functions": _refused(CHAT, "deprecated: use tools"),
    "function_call": _refused(CHAT, "deprecated: use tool_choice"),
    # ---- OpenAI, completions only ---------------------------------------------------------
    "prompt": _implemented(COMPLETIONS, "text or token ids, one prompt per request"),
    "best_of": _implemented(COMPLETIONS, "choices.py: the n likeliest samples"),
    "suffix": _refused(COMPLETIONS, "no text after the completion", ""),
    # ---- vLLM extensions --------------------------------------------------------------------
    "echo": _implemented(BOTH, "completions: the prompt before the completion (echo.py)"),
    "top_k": _implemented(BOTH, "SamplingParams"),
    "min_tokens": _implemented(BOTH, "SamplingParams"),
    "repetition_penalty": _implemented(BOTH, "pdserve/model/penalties.py"),
    "stop_token_ids": _implemented(BOTH, "SamplingParams"),
    "ignore_eos": _implemented(BOTH, "SamplingParams"),
    "cache_salt": _implemented(BOTH, "the request's cache scope (scope.py)"),
    "guided_json": _implemented(BOTH, "structured.py"),
    "guided_regex": _implemented(BOTH, "structured.py"),
    "guided_choice": _implemented(BOTH, "structured.py"),
    "guided_grammar": _implemented(BOTH, "structured.py"),
    "structured_outputs": _implemented(BOTH, "structured.py"),
    "guided_whitespace_pattern": _implemented(BOTH, "structured.py refuses it"),
    "guided_decoding_backend": _implemented(BOTH, "structured.py refuses it"),
    "structural_tag": _implemented(BOTH, "structured.py refuses it"),
    "request_id": _metadata(BOTH, str, "the router names each request itself (X-Request-Id)"),
    "min_p": _refused(BOTH, "no min-p sampling", 0, 0.0),
    "use_beam_search": _refused(BOTH, "no beam search", False),
    "length_penalty": _refused(BOTH, "beam search only", 1, 1.0),
    "include_stop_str_in_output": _refused(BOTH, "stop strings are cut", False),
    "skip_special_tokens": _refused(BOTH, "special tokens are skipped", True),
    "spaces_between_special_tokens": _refused(BOTH, "the detokenizer's default", True),
    "truncate_prompt_tokens": _refused(BOTH, "an over-long prompt is a 400, never cut"),
    "prompt_logprobs": _refused(BOTH, "completions: echo with logprobs scores the prompt"),
    "allowed_token_ids": _refused(BOTH, "use logit_bias or a grammar"),
    "bad_words": _refused(BOTH, "use logit_bias"),
    "priority": _refused(BOTH, "first come, first served", 0),
    "logits_processors": _refused(BOTH, "no custom logits processors"),
    "return_tokens_as_token_ids": _refused(BOTH, "logprobs name tokens by text", False),
    "return_token_ids": _refused(BOTH, "text only", False),
    "kv_transfer_params": _refused(BOTH, "the router drives prefill and decode itself"),
    "vllm_xargs": _refused(BOTH, "no extra vLLM arguments"),
    "add_special_tokens": _refused(BOTH, "the tokenizer's default for the endpoint"),
    "prompt_embeds": _refused(COMPLETIONS, "token ids or text only"),
    "add_generation_prompt": _refused(CHAT, "the assistant turn is always opened", True),
    "continue_final_message": _refused(CHAT, "a final message is never continued", False),
    "documents": _refused(CHAT, "no RAG documents in the template"),
    "chat_template": _refused(CHAT, "the served model's template only"),
    "chat_template_kwargs": _refused(CHAT, "the served model's template only"),
    "mm_processor_kwargs": _refused(CHAT, "text only"),
}


def check_fields(body: dict[str, Any], chat: bool, max_messages: int) -> FieldError | None:
    """The refusal (the API's 400) of the first field of `body` that is unknown on this
    endpoint, refused at its value, or metadata of the wrong type; of a chat body of more than
    `max_messages` messages (counted before anything walks them: rendering scales with their
    number), or of one that is not an object. None: nothing to refuse."""
    endpoint = CHAT if chat else COMPLETIONS
    for name, value in body.items():
        spec = FIELDS.get(name)
        if spec is None or spec.where not in (endpoint, BOTH):
            return FieldError(_param(name), _unknown(name, endpoint, spec))
        if spec.how == REFUSED and not _is_accepted(value, spec.accepted):
            return FieldError(name, f"{name}={show(value)} is not supported here ({spec.why})")
        if spec.how == METADATA and value is not None and not isinstance(value, spec.kind):
            return FieldError(name, f"{name} must be {_kind_name(spec.kind)}")
    messages = body.get("messages")
    if not chat or not isinstance(messages, list):
        return None  # parse_messages() names what is wrong with them
    if len(messages) > max_messages:
        message = f"messages holds at most {max_messages} entries (max_messages)"
        return FieldError("messages", message)
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return FieldError("messages", f"messages[{index}] must be an object")
    return None


def _unknown(name: str, endpoint: str, spec: Field | None) -> str:
    path = _PATHS[endpoint]
    if spec is not None:
        return f"{show(name)} is a field of {_PATHS[spec.where]}, not of {path}"
    known = [n for n, f in FIELDS.items() if f.where in (endpoint, BOTH)]
    hint = suggest(name, known) if len(name) <= 64 else ""  # difflib is quadratic
    return f"unknown field {show(name)} in a {path} body{hint}"


def _is_accepted(value: Any, accepted: tuple[Any, ...]) -> bool:
    # JSON true is not the number 1, nor 1.0 true: types must match as well as values.
    return any(value == ok and type(value) is type(ok) for ok in accepted)


def _kind_name(kind: Any) -> str:
    return {str: "a string", dict: "an object"}.get(kind, "of another type")


def _param(name: str) -> str:
    return name if len(name) <= 64 else name[:64]


def show(value: Any) -> str:
    """A value for an error message, cut short: the client sent it and may have sent a lot."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} chars)"


def typed(
    body: dict[str, Any], name: str, kind: type, default: Any = None, prefix: str = ""
) -> Any:
    """`body[name]` checked against `kind` (null means the default), or a FieldError naming
    it. A float field takes ints; no field takes a bool unless it is one (JSON true is not
    the number 1); no integer beyond 64 bits passes (msgpack cannot carry it to a worker)."""
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if kind is float:
        ok = is_int(value) or isinstance(value, float)
    where = f"{prefix}{name}"
    if not ok:
        kind_name = {str: "a string", int: "an integer", float: "a number", bool: "a boolean"}
        expected = kind_name.get(kind, "an object")
        raise FieldError(where, f"{where} must be {expected}, got {show(value)}")
    if is_int(value) and not INT64_MIN <= value <= INT64_MAX:
        raise FieldError(where, f"{where} must fit in 64 bits, got {show(value)}")
    return float(value) if kind is float else value


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
