"""Structured-output fields: parsed into the request's sampling, or a 400 naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.router.config import RouterConfig
from pdserve.router.protocol import ApiError, parse_request

CONFIG = RouterConfig(model="m")
MSGS = [{"role": "user", "content": "hi"}]


def parse(**fields: Any):
    return parse_request({"messages": MSGS, **fields}, chat=True, config=CONFIG)


def test_text_response_format_is_accepted() -> None:
    parse(response_format={"type": "text"})
    parse(response_format=None)


@pytest.mark.parametrize("fmt", [{"type": "json_object"}, {"type": "xml"}, "json", 3])
def test_unsupported_response_format_is_refused_by_name(fmt: Any) -> None:
    with pytest.raises(ApiError) as info:
        parse(response_format=fmt)
    assert info.value.status == 400 and info.value.param == "response_format"
