"""Tool calls in responses: a whole chat body rewritten with `tool_calls`, and a stream of
text deltas turned into OpenAI's streamed tool-call deltas.

Streaming holds back only what may still become a call: text after `<tool_call>` until its
`</tool_call>` arrives (then the call goes out as two deltas: index, id, type and name with
empty arguments, then the arguments), the tail of the text that could be the start of
`<tool_call>`, and, where the whole output is calls (a required or named call, or Llama 3
JSON starting with `{`), everything until the end. Everything else streams as content.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pdserve.router.tools import CALL_CLOSE, CALL_OPEN, ToolSpec, finish_reason, parse_calls


@dataclass
class ToolDelta:
    """One chunk's worth: content text, call deltas, the finish reason on the last."""

    text: str
    finish_reason: str | None
    tool_calls: list[dict[str, Any]] | None = None
    logprobs: list[Any] | None = None  # the driver's, passed on with the tokens they describe


def rewrite_body(body: dict[str, Any], spec: ToolSpec, on_failed: Callable[[int], None]) -> None:
    """A whole chat completion's message and finish reason, with the calls it holds."""
    choice = body["choices"][0]
    message = choice["message"]
    content, calls, failed = parse_calls(message["content"] or "", spec)
    if failed:
        on_failed(failed)
    if calls:
        message["content"] = content
        message["tool_calls"] = calls
        choice["finish_reason"] = finish_reason(choice["finish_reason"], calls)


async def tool_deltas(
    spec: ToolSpec, deltas: AsyncIterator[Any], on_failed: Callable[[int], None]
) -> AsyncIterator[ToolDelta]:
    """The driver's text deltas as content and tool-call deltas. The first delta always goes
    out (the response's headers wait for it), later empty ones do not."""
    stream = _CallStream(spec)
    first = True
    async for delta in deltas:
        text, calls = stream.push(delta.text)
        reason = delta.finish_reason
        if reason is not None:
            tail, more = stream.finish()
            text, calls = text + tail, calls + more
            if stream.failed:
                on_failed(stream.failed)
            reason = finish_reason(reason, [None] * stream.num_calls)
        logprobs = getattr(delta, "logprobs", None)
        if text or first or logprobs or (reason is not None and not calls):
            yield ToolDelta(text, None if calls else reason, None, logprobs)
        first = False
        for index, call in enumerate(calls):
            last = reason is not None and index == len(calls) - 1
            yield ToolDelta("", reason if last else None, [call])


class _CallStream:
    def __init__(self, spec: ToolSpec) -> None:
        self.spec = spec
        self.held = ""
        self.num_calls = 0
        self.failed = 0
        # None: not known yet (Llama 3 JSON under "auto": known at the first non-space char).
        self.whole: bool | None = spec.choice in ("required", "named") or None
        if self.whole is None and spec.format != "llama3_json":
            self.whole = False

    def push(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.held += text
        if self.whole is None and self.held.strip():
            self.whole = self.held.lstrip().startswith("{")
        if self.whole is not False:
            return "", []
        if self.spec.format == "llama3_json":  # plain text under "auto"
            out, self.held = self.held, ""
            return out, []
        out, deltas = [], []
        while True:
            start = self.held.find(CALL_OPEN)
            if start < 0:
                keep = _prefix_len(self.held, CALL_OPEN)
                out.append(self.held[: len(self.held) - keep])
                self.held = self.held[len(self.held) - keep :]
                break
            end = self.held.find(CALL_CLOSE, start)
            if end < 0:
                out.append(self.held[:start])
                self.held = self.held[start:]
                break
            block = self.held[start : end + len(CALL_CLOSE)]
            _, calls, failed = parse_calls(block, self.spec)
            self.failed += failed
            out.append(self.held[:start] if calls else self.held[: end + len(CALL_CLOSE)])
            deltas += self._deltas(calls)
            self.held = self.held[end + len(CALL_CLOSE) :]
        text = "".join(out)
        return ("" if self.num_calls and not text.strip() else text), deltas

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        text, self.held = self.held, ""
        if not self.whole:
            return text, []
        content, calls, failed = parse_calls(text, self.spec)
        self.failed += failed
        return (content or "") if calls else text, self._deltas(calls)

    def _deltas(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for call in calls:
            function = call["function"]
            head = {**call, "function": {"name": function["name"], "arguments": ""}}
            out.append({"index": self.num_calls, **head})
            out.append({"index": self.num_calls, "function": {"arguments": function["arguments"]}})
            self.num_calls += 1
        return out


def _prefix_len(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0
