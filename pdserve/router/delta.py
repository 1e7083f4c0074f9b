"""What a request's driver streams to the route that answers it: text and, per token, what
the client asked to see with it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Delta:
    text: str
    finish_reason: str | None  # set on the last delta only
    logprobs: list[list[Any]] | None = None  # per token: [id, logprob, top] (router/logprobs.py)
    # With the first token, when SamplingParams.prompt_logprobs is set: one per prompt token,
    # None for the first, else [logprob, top] (Tokens.prompt_logprobs; router/echo.py).
    prompt_logprobs: list[Any] | None = None
