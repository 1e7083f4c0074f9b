"""OpenAI's sampling fields that are not SamplingParams as they stand: `logit_bias` (a JSON
object keyed by token id strings), `logprobs`/`top_logprobs` (two spellings, chat and
completions), `n` and `best_of` (how many samples; router/choices.py runs them), `echo`
(router/echo.py). Each
refusal is a FieldError naming the field, which protocol.py answers with a 400."""

from __future__ import annotations

from typing import Any

from pdserve.router.fields import show, typed
from pdserve.router.structured import FieldError

_MAX_INT_DIGITS = 20  # as protocol.py: longer literals are no token id


def parse_logprobs(body: dict[str, Any], chat: bool, limit: int) -> int | None:
    """How many alternatives to report with each token, or None for no logprobs at all.
    Chat: `logprobs: bool` and `top_logprobs: int`; completions: `logprobs: int`."""
    name = "top_logprobs" if chat else "logprobs"
    if chat:
        wanted = typed(body, "logprobs", bool) or False
        num_top = typed(body, "top_logprobs", int)
        if num_top is not None and not wanted:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
        num_top = (num_top or 0) if wanted else None
    else:
        num_top = typed(body, "logprobs", int)
    if num_top is not None and not 0 <= num_top <= limit:
        raise FieldError(name, f"{name} must be in [0, {limit}], got {num_top}")
    return num_top


def parse_logit_bias(body: dict[str, Any], limit: int) -> list[list[Any]]:
    """OpenAI's {"token id": bias} as [id, bias] pairs; SamplingParams checks the biases'
    range, protocol.check_token_ids the ids against the vocabulary."""
    bias = typed(body, "logit_bias", dict) or {}
    if len(bias) > limit:
        raise FieldError("logit_bias", f"logit_bias holds at most {limit} token ids")
    pairs = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= _MAX_INT_DIGITS):
            raise FieldError("logit_bias", f"logit_bias keys must be token ids, got {show(key)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            message = f"logit_bias values must be numbers, got {show(value)}"
            raise FieldError("logit_bias", message)
        pairs.append([int(key), float(value)])
    return pairs


def parse_samples(
    body: dict[str, Any], chat: bool, stream: bool, limit: int
) -> tuple[int, int | None]:
    """(n, best_of): `n` choices returned, of `best_of` sampled (None: n). `best_of` is
    completions' alone, at least n, and cannot be streamed when it exceeds n (vLLM's rule:
    the n best are known only at the end)."""
    n = typed(body, "n", int)
    n = 1 if n is None else n
    if not 1 <= n <= limit:
        raise FieldError("n", f"n must be in [1, {limit}], got {n}")
    best_of = typed(body, "best_of", int)
    if best_of is None or best_of == 1 and n == 1:
        return n, None
    if chat:
        raise FieldError("best_of", "best_of is a completions field; chat takes n alone")
    if not n <= best_of <= limit:
        raise FieldError("best_of", f"best_of must be in [n, {limit}], got {best_of} (n={n})")
    if stream and best_of > n:
        raise FieldError("best_of", "best_of > n cannot be streamed")
    return n, best_of


def parse_echo(body: dict[str, Any], chat: bool, max_tokens: int | None) -> bool:
    """Completions' `echo` (router/echo.py): a boolean, false on chat (vLLM's chat echo
    repeats the last message, another feature). `max_tokens: 0` (score the prompt, generate
    nothing) needs it."""
    echo = typed(body, "echo", bool) or False
    if echo and chat:
        raise FieldError("echo", "echo is supported on /v1/completions only")
    if max_tokens == 0 and not echo:
        raise FieldError("max_tokens", "max_tokens must be >= 1 (0 only with echo: true)")
    return echo
