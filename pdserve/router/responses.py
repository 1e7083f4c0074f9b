"""OpenAI response and stream-chunk bodies, exactly in the shapes the official SDKs parse."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from pdserve.router.logprobs import Entry, LogprobsFormatter

_TEXT_SLOT = "\x00pdserve-text\x00"  # where a token chunk's text goes (json writes \u0000)


@dataclass
class ResponseContext:
    """What every chunk of one response repeats: the same id, created time and model."""

    chat: bool
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    logprobs: LogprobsFormatter | None = None  # the request asked for logprobs
    _text_chunk: tuple[bytes, bytes] | None = field(default=None, init=False, repr=False)

    def text_chunk(self, text: str) -> bytes:
        """`sse(body(self, text, stream=True))`, a stream's chunk after the first with text
        alone (no finish reason, no logprobs): the bytes around the text are made once per
        response, from that same call, and the text is JSON-encoded as json.dumps does."""
        if self._text_chunk is None:
            whole = sse(body(self, _TEXT_SLOT, stream=True))
            head, _, tail = whole.partition(json.dumps(_TEXT_SLOT).encode())
            self._text_chunk = (head, tail)
        head, tail = self._text_chunk
        return head + _encode_json_str(text).encode() + tail

    def format_logprobs(self, entries: list[Entry]) -> dict[str, Any] | None:
        return None if self.logprobs is None else self.logprobs.format(entries)

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"


def usage(
    num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0
) -> dict[str, Any]:
    """OpenAI usage; `prompt_tokens_details.cached_tokens` counts prompt tokens served from
    the prefix cache instead of computed."""
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def body(
    ctx: ResponseContext,
    text: str | None,
    finish_reason: str | None = None,
    *,
    stream: bool,
    first: bool = False,
    usage: dict[str, Any] | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A whole response, or (`stream`) one delta: the first chat delta carries `role:
    assistant` (the SDKs and most UIs read the role from it). `text` None: no choices, as in
    the final chunk for `stream_options.include_usage`."""
    if not ctx.chat:
        kind, key, value = "text_completion", "text", text
    elif stream:
        kind, key = "chat.completion.chunk", "delta"
        value = {"role": "assistant", "content": text} if first else {}
        if not first and (text or finish_reason is None):
            value["content"] = text
    else:
        kind, key, value = "chat.completion", "message", {"role": "assistant", "content": text}
    choice = {"index": 0, key: value, "logprobs": logprobs, "finish_reason": finish_reason}
    choices = [] if text is None else [choice]
    out = {"id": ctx.id, "object": kind, "created": ctx.created, "model": ctx.model}
    return {**out, "choices": choices, **({} if usage is None else {"usage": usage})}


def sse(body: dict[str, Any] | str) -> bytes:
    data = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


SSE_DONE = sse("[DONE]")
_encode_json_str = json.encoder.encode_basestring_ascii  # json.dumps(str), ensure_ascii on


class EventStream(web.StreamResponse):
    """An SSE response each of whose writes must drain within `write_timeout_s`. A client
    that stops reading is cut off (ConnectionResetError, as if it had left, so the request
    is aborted on its workers) instead of holding a request slot, the workers' KV blocks and
    a socket buffer for as long as it likes. Memory per such client stays within the
    transport's write buffer: a write waits for it to drain below its high-water mark."""

    def __init__(self, write_timeout_s: float) -> None:
        super().__init__(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        self.write_timeout_s = write_timeout_s
        self._request: web.BaseRequest | None = None

    async def prepare(self, request: web.BaseRequest) -> Any:
        self._request = request
        return await bounded(request, super().prepare(request), self.write_timeout_s)

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        await bounded(self._request, super().write(data), self.write_timeout_s)

    async def write_eof(self, data: bytes = b"") -> None:
        await bounded(self._request, super().write_eof(data), self.write_timeout_s)


async def bounded(request: web.BaseRequest | None, write: Awaitable[Any], timeout_s: float) -> Any:
    """`write`, or, when the client leaves it undrained for `timeout_s`, its connection and
    whatever is still buffered for it dropped (ConnectionResetError, as if it had left)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await write
    except TimeoutError:
        if request is not None and request.transport is not None:
            request.transport.abort()
        raise ConnectionResetError(f"client read nothing for {timeout_s} s; dropped") from None
