"""OpenAI request bodies -> one validated internal `ApiRequest`, or an `ApiError` (4xx).

Validation happens here, before any worker hears of the request, so a bad field costs a 400
naming it and never a half-started request. Sampling values are checked by `SamplingParams`
itself (one source of truth); its ValueError names the field, which becomes the error's `param`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pdserve.sampling_params import SamplingParams


class ApiError(Exception):
    """An error returned to the client as OpenAI's error JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


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


# Fields we do not implement: accepted only at their "off" value, else a 400 naming them
# (silently ignoring e.g. logprobs would return a response the client did not ask for).
_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "suffix": (None, ""),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "min_tokens": (None, 0),
}


def check_model(model: Any, served_model: str) -> None:
    """The OpenAI error for a request naming a model this server does not serve."""
    if model != served_model:
        raise ApiError(
            404,
            f"The model `{model}` does not exist; this server serves `{served_model}`",
            param="model",
            code="model_not_found",
        )


def parse_request(body: Any, chat: bool, served_model: str, max_tokens_limit: int) -> ApiRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    model = _field(body, "model", str, served_model)
    check_model(model, served_model)
    for name, allowed in _OFF_VALUES.items():
        value = body.get(name)
        if not any(value == ok and type(value) is type(ok) for ok in allowed):
            raise ApiError(400, f"{name}={value!r} is not supported by this server", param=name)
    stream = _field(body, "stream", bool, False) or False
    stream_options = _field(body, "stream_options", dict, None)
    include_usage = False
    if stream_options is not None:
        if not stream:
            raise ApiError(
                400, "stream_options is only allowed when stream is true", param="stream"
            )
        include_usage = _field(stream_options, "include_usage", bool, False, "stream_options.")
    if chat:
        messages = parse_messages(body)
        prompt = None
        max_tokens = _field(body, "max_completion_tokens", int, None)
        if max_tokens is None:
            max_tokens = _field(body, "max_tokens", int, None)
    else:
        messages = None
        prompt = _parse_prompt(body)
        max_tokens = _field(body, "max_tokens", int, None)
    if max_tokens is not None and max_tokens > max_tokens_limit:
        raise ApiError(
            400, f"max_tokens must be <= {max_tokens_limit}, got {max_tokens}", param="max_tokens"
        )
    sampling = _parse_sampling(body)
    return ApiRequest(chat, model, prompt, messages, max_tokens, sampling, stream, include_usage)


def finalize_sampling(
    request: ApiRequest, num_prompt_tokens: int, max_model_len: int | None
) -> SamplingParams:
    """The request's SamplingParams once the prompt length and context limit are known.

    Like vLLM: a prompt must leave room for one token; an explicit max_tokens that overruns
    the context is an error; the default (16 for completions, the rest of the context for
    chat, as OpenAI's "unlimited") is clipped to fit.
    """
    prompt_param = "messages" if request.chat else "prompt"
    if max_model_len is not None and num_prompt_tokens >= max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{num_prompt_tokens} tokens, which leaves no room for output",
            param=prompt_param,
            code="context_length_exceeded",
        )
    room = None if max_model_len is None else max_model_len - num_prompt_tokens
    max_tokens = request.max_tokens
    if max_tokens is None:
        max_tokens = 16 if not request.chat or room is None else room
        max_tokens = max_tokens if room is None else min(max_tokens, room)
    elif room is not None and max_tokens > room and max_tokens >= 1:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens; you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, "
            f"{max_tokens} for the completion)",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return _sampling_params({**request.sampling, "max_tokens": max_tokens})


def sampling_to_wire(params: SamplingParams) -> dict[str, Any]:
    """The dict workers rebuild with `SamplingParams(**d)` (tuples as lists for msgpack)."""
    return {
        k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(params).items()
    }


def _parse_sampling(body: dict[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for name, kind in (("temperature", float), ("top_p", float), ("top_k", int)):
        value = _field(body, name, kind, None)
        if value is not None:
            kwargs[name] = value
    kwargs["seed"] = _field(body, "seed", int, None)
    kwargs["ignore_eos"] = _field(body, "ignore_eos", bool, False) or False
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "stop must be a string or a list of strings", param="stop")
    kwargs["stop"] = stop
    stop_token_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_token_ids, list):
        raise ApiError(400, "stop_token_ids must be a list of integers", param="stop_token_ids")
    kwargs["stop_token_ids"] = stop_token_ids
    _sampling_params({**kwargs, "max_tokens": 1})  # validate now: fail before tokenizing
    return kwargs


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
    if isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(
            400, "batched prompts are not supported; send one per request", param="prompt"
        )
    raise ApiError(
        400, "prompt must be a non-empty string or a non-empty list of token ids", param="prompt"
    )


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
            raise ApiError(
                400,
                f"messages[{index}].role must be one of {_ROLES}, got {role!r}",
                param="messages",
            )
        if isinstance(message, dict) and isinstance(message.get("content"), list):
            parts = message["content"]
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in parts):
                raise ApiError(
                    400, f"messages[{index}]: only text content is supported", param="messages"
                )
            message = {**message, "content": "".join(str(p.get("text", "")) for p in parts)}
        out.append(message)
    return out


def _field(body: dict[str, Any], name: str, kind: type, default: Any, prefix: str = "") -> Any:
    """`body[name]` checked against `kind` (null means the default). A float field takes
    ints; no field takes a bool unless it is one (JSON true is not the number 1)."""
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if kind is float:
        ok = _is_int(value) or (isinstance(value, float))
    if not ok:
        kind_name = {str: "a string", int: "an integer", float: "a number", bool: "a boolean"}
        expected = kind_name.get(kind, "an object")
        raise ApiError(
            400, f"{prefix}{name} must be {expected}, got {value!r}", param=f"{prefix}{name}"
        )
    return float(value) if kind is float else value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
