"""OpenAI request bodies -> one validated internal `ApiRequest`, or an `ApiError` (4xx).

Validation happens here, before any worker hears of the request, so a bad field costs a 400
naming it and never a half-started request. Sampling values are checked by `SamplingParams`
itself (one source of truth); its ValueError names the field, which becomes the error's `param`.

Hostile input is refused here too, each with a 400 naming the field: integers beyond 64 bits
(msgpack cannot carry them to a worker), lone UTF-16 surrogates (no UTF-8 form, so neither
the tokenizer nor msgpack can take them), nesting deeper than any OpenAI body needs, and more
or longer stop strings than the router matches per token (`RouterConfig.max_num_stop`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import KW_ONLY, dataclass
from typing import Any

from pdserve.router.config import RouterConfig
from pdserve.router.fields import INT64_MAX, INT64_MIN, check_fields, is_int, show, typed
from pdserve.router.sampling_fields import (
    parse_echo,
    parse_logit_bias,
    parse_logprobs,
    parse_samples,
)
from pdserve.router.structured import FieldError, parse_structured
from pdserve.router.tools import ToolSpec, parse_tools
from pdserve.router.tools import attach as attach_tools
from pdserve.sampling_params import SamplingParams

MAX_JSON_DEPTH = 16  # an OpenAI body nests 5 deep (messages[i].content[j].text)
_MAX_INT_DIGITS = 20  # longer integer literals are parsed as an out-of-range stand-in
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # how a lone surrogate enters JSON
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(eq=False)
class ApiError(Exception):
    """An error returned to the client as OpenAI's error JSON."""

    status: int
    message: str
    _: KW_ONLY
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after_s: int | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return {"error": {k: getattr(self, k) for k in ("message", "type", "param", "code")}}


def bad_gateway(message: str) -> ApiError:
    """502: a worker failed or answered out of turn, and recovery could not mend it."""
    return ApiError(502, message, type="server_error")


def unavailable(message: str) -> ApiError:
    """503, "try again in a second": no capacity now (every worker full, none healthy)."""
    return ApiError(503, message, type="service_unavailable", code="overloaded", retry_after_s=1)


@dataclass
class ApiRequest:
    """A parsed request. `prompt` is text or token ids (completions); `messages` (chat) is
    turned into ids by the chat template. `max_tokens` None means "the default", resolved by
    `finalize_sampling` once the prompt length is known."""

    chat: bool
    model: str
    prompt: str | list[int] | None
    messages: list[dict[str, Any]] | None
    max_tokens: int | None
    sampling: dict[str, Any]  # SamplingParams kwargs except max_tokens
    stream: bool
    include_usage: bool
    tools: ToolSpec | None = None  # chat only (router/tools.py)
    n: int = 1  # choices returned (router/choices.py)
    best_of: int | None = None  # completions: samples drawn, the n likeliest returned
    echo: bool = False  # completions: the prompt before the completion (router/echo.py)


def check_model(model: Any, served_model: str) -> None:
    """The OpenAI error for a request naming a model this server does not serve."""
    if model != served_model:
        message = f"The model {show(model)} does not exist; this server serves `{served_model}`"
        raise ApiError(404, message, param="model", code="model_not_found")


def parse_json(raw: bytes) -> Any:
    """The JSON body, or a 400. Integer literals too long for 64 bits become a stand-in that
    is out of range, so the field's own check names it (Python would otherwise parse, or
    refuse with a ValueError, a number of any length)."""
    try:
        body = json.loads(raw.decode("utf-8"), parse_int=_parse_int)
    except UnicodeDecodeError:
        raise ApiError(400, "request body is not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    _check_tree(body, check_strings=_SURROGATE_ESCAPE.search(raw) is not None)
    return body


def _parse_int(literal: str) -> int:
    if len(literal) <= _MAX_INT_DIGITS:
        return int(literal)
    return INT64_MIN * 2 if literal.startswith("-") else INT64_MAX * 2


def _check_tree(root: Any, check_strings: bool) -> None:
    """400 naming the first value nested deeper than MAX_JSON_DEPTH or (when the raw body
    escapes a surrogate at all) the first string holding a lone surrogate."""
    stack: list[tuple[Any, str, int]] = [(root, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise ApiError(400, f"{path} holds a lone UTF-16 surrogate", param=path or None)
            continue
        if depth >= MAX_JSON_DEPTH:
            raise ApiError(400, f"{path} nests deeper than {MAX_JSON_DEPTH} levels", param=path)
        if isinstance(value, dict):
            for key, item in value.items():
                if check_strings and _SURROGATE.search(key):
                    where = path or "the body"
                    message = f"a key in {where} holds a lone UTF-16 surrogate"
                    raise ApiError(400, message, param=path or None)
                if isinstance(item, (dict, list)) or (check_strings and isinstance(item, str)):
                    stack.append((item, f"{path}.{key}" if path else key, depth + 1))
        else:
            for index, item in enumerate(value):
                if isinstance(item, (dict, list)) or (check_strings and isinstance(item, str)):
                    stack.append((item, f"{path}[{index}]", depth + 1))


def parse_request(
    body: Any, chat: bool, config: RouterConfig, chat_template: str | None = None
) -> ApiRequest:
    """`chat_template` (the served model's) picks the family's tool-call format."""
    try:
        return _parse_request(body, chat, config, chat_template)
    except FieldError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None


def _parse_request(
    body: Any, chat: bool, config: RouterConfig, chat_template: str | None
) -> ApiRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    if (refusal := check_fields(body, chat, config.max_messages)) is not None:
        raise ApiError(400, str(refusal), param=refusal.param)
    served_model = config.model
    model = typed(body, "model", str, served_model)
    check_model(model, served_model)
    stream = typed(body, "stream", bool, False) or False
    stream_options = typed(body, "stream_options", dict, None)
    if stream_options is not None and not stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", param="stream")
    include_usage = typed(stream_options or {}, "include_usage", bool, False, "stream_options.")
    messages = parse_messages(body) if chat else None
    prompt = None if chat else _parse_prompt(body)
    max_tokens = typed(body, "max_completion_tokens", int, None) if chat else None
    if max_tokens is None:
        max_tokens = typed(body, "max_tokens", int, None)
    if max_tokens is not None and max_tokens > config.max_tokens_limit:
        limit = config.max_tokens_limit
        raise ApiError(400, f"max_tokens must be <= {limit}, got {max_tokens}", param="max_tokens")
    sampling = _parse_sampling(body, config)
    sampling["logprobs"] = parse_logprobs(body, chat, config.max_logprobs)
    sampling["logit_bias"] = parse_logit_bias(body, config.max_logit_bias)
    n, best_of = parse_samples(body, chat, stream, config.max_n)
    echo = parse_echo(body, chat, max_tokens)
    sampling["prompt_logprobs"] = sampling["logprobs"] if echo else None
    sampling.update(parse_structured(body))
    tools = parse_tools(body) if chat else None
    if tools is not None:
        tools = attach_tools(tools, chat_template, sampling)
    if tools is not None and tools.parses and (n > 1 or best_of is not None):
        raise FieldError("n", "n > 1 and best_of are not supported with tools")
    if not chat and body.get("tools"):
        raise ApiError(400, "tools are supported on /v1/chat/completions only", param="tools")
    return ApiRequest(
        chat,
        model,
        prompt,
        messages,
        max_tokens,
        sampling,
        stream,
        include_usage,
        tools,
        n,
        best_of,
        echo,
    )


def check_prompt_chars(
    request: ApiRequest, max_token_chars: int, max_model_len: int | None
) -> None:
    """Refuse, before tokenizing, text that cannot fit the context whatever its tokens: no
    token covers more than `max_token_chars` characters, and every chat message renders to
    at least one token (one that rendered to none would be no message at all). Tokenizing
    costs time proportional to the text, so a prompt that is sure to fail must not pay it."""
    if max_model_len is None or isinstance(request.prompt, list):
        return  # no worker ready yet, or token ids (finalize_sampling counts those)
    messages = request.messages or []
    contents = (m.get("content") for m in messages)
    num_chars = sum(len(c) for c in contents if isinstance(c, str)) + len(request.prompt or "")
    too_many = len(messages) > max_model_len
    if too_many or num_chars > max_model_len * max_token_chars:
        what = f"{len(messages)} messages" if too_many else f"{num_chars} characters"
        what = f"the prompt has {what}, more than that many tokens can hold"
        raise too_long(max_model_len, what, "messages" if request.chat else "prompt")


def finalize_sampling(
    request: ApiRequest, num_prompt_tokens: int, max_model_len: int | None
) -> SamplingParams:
    """The request's SamplingParams once the prompt length and context limit are known.

    Like vLLM: a prompt must leave room for one token; an explicit max_tokens that overruns
    the context is an error; the default (16 for completions, the rest of the context for
    chat, as OpenAI's "unlimited") is clipped to fit.
    """
    if max_model_len is not None and num_prompt_tokens >= max_model_len:
        what = f"the prompt has {num_prompt_tokens} tokens, which leaves no room for output"
        raise too_long(max_model_len, what, "messages" if request.chat else "prompt")
    room = None if max_model_len is None else max_model_len - num_prompt_tokens
    max_tokens = request.max_tokens
    if max_tokens is None:
        max_tokens = 16 if not request.chat or room is None else room
        max_tokens = max_tokens if room is None else min(max_tokens, room)
    elif max_tokens == 0 and request.echo:
        max_tokens = 1  # as vLLM: one token is generated and dropped (router/echo.py)
    elif room is not None and max_tokens > room and max_tokens >= 1:
        what = (
            f"you requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in "
            f"the prompt, {max_tokens} for the completion)"
        )
        raise too_long(max_model_len, what, "max_tokens")
    return _sampling_params({**request.sampling, "max_tokens": max_tokens})


def too_long(max_model_len: int, what: str, param: str) -> ApiError:
    message = f"This model's maximum context length is {max_model_len} tokens; {what}"
    return ApiError(400, message, param=param, code="context_length_exceeded")


def sampling_to_wire(params: SamplingParams) -> dict[str, Any]:
    """The dict workers rebuild with `SamplingParams(**d)` (tuples as lists for msgpack)."""
    return {
        k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(params).items()
    }


def _parse_sampling(body: dict[str, Any], config: RouterConfig) -> dict[str, Any]:
    fields = (
        ("temperature", float),
        ("top_p", float),
        ("top_k", int),
        ("min_tokens", int),
        ("presence_penalty", float),
        ("frequency_penalty", float),
        ("repetition_penalty", float),
    )
    kwargs = {n: v for n, kind in fields if (v := typed(body, n, kind, None)) is not None}
    kwargs["seed"] = typed(body, "seed", int, None)
    kwargs["ignore_eos"] = typed(body, "ignore_eos", bool, False) or False
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "stop must be a string or a list of strings", param="stop")
    if len(stop) > config.max_num_stop:
        raise ApiError(400, f"stop holds at most {config.max_num_stop} strings", param="stop")
    if any(len(s) > config.max_stop_len for s in stop):
        raise ApiError(400, f"stop strings hold at most {config.max_stop_len} chars", param="stop")
    kwargs["stop"] = stop
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list) or not all(is_int(t) and 0 <= t <= INT64_MAX for t in ids):
        message = "stop_token_ids must be a list of non-negative token ids"
        raise ApiError(400, message, param="stop_token_ids")
    if len(ids) > config.max_num_stop:
        message = f"stop_token_ids holds at most {config.max_num_stop} ids"
        raise ApiError(400, message, param="stop_token_ids")
    kwargs["stop_token_ids"] = ids
    # Validate now, to fail before tokenizing; finalize_sampling checks max_tokens itself.
    _sampling_params({**kwargs, "max_tokens": max(1, kwargs.get("min_tokens", 0))})
    return kwargs


def check_token_ids(request: ApiRequest, vocab_size: int) -> None:
    """400 naming `logit_bias` when one of its ids is past the vocabulary."""
    if any(token_id >= vocab_size for token_id, _ in request.sampling.get("logit_bias", ())):
        message = f"logit_bias token ids must be < vocab size {vocab_size}"
        raise ApiError(400, message, param="logit_bias")


def _sampling_params(kwargs: dict[str, Any]) -> SamplingParams:
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        message = str(exc)  # SamplingParams messages start with the field's name
        raise ApiError(400, message, param=message.split(" ", 1)[0]) from None


def _parse_prompt(body: dict[str, Any]) -> str | list[int]:
    if "prompt" not in body:
        raise ApiError(400, "prompt is required", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(is_int(t) and t >= 0 for t in prompt):
        return prompt
    message = "prompt must be a non-empty string or a non-empty list of token ids"
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        message = "batched prompts are not supported; send one per request"
    raise ApiError(400, message, param="prompt")


_ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Messages with text-part lists flattened to strings (what the OpenAI SDK may send); the
    tokenizer checks roles and contents when it renders the template."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    out = []
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if isinstance(role, str) and role not in _ROLES:
            text = f"messages[{index}].role must be one of {_ROLES}, got {role!r}"
            raise ApiError(400, text, param="messages")
        if isinstance(message, dict) and isinstance(message.get("content"), list):
            parts = message["content"]
            texts = [
                p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None
                for p in parts
            ]
            if not all(isinstance(t, str) for t in texts):
                text = "only parts {type: text, text: string} are supported"
                raise ApiError(400, f"messages[{index}].content: {text}", param="messages")
            message = {**message, "content": "".join(texts)}
        out.append(message)
    return out
