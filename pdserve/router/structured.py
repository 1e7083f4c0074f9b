"""Structured-output fields of an OpenAI body -> a validated spec, or a 400 naming the field.

`response_format` is never silently ignored: a client that asks for JSON and gets free text
with a 200 fails later, at `json.loads`, far from the cause.
"""

from __future__ import annotations

from typing import Any

from pdserve.router.protocol import ApiError


def parse_structured(body: dict[str, Any]) -> None:
    """400 for a `response_format` other than {"type": "text"}."""
    fmt = body.get("response_format")
    if fmt is None or fmt == {"type": "text"}:
        return
    raise ApiError(
        400,
        "response_format other than {type: text} is not supported here",
        param="response_format",
    )
