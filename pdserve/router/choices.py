"""Several choices for one prompt: `n` (chat and completions) and `best_of` (completions).

One prefill serves them all: the first sample runs alone until its first token is out, so
its prompt's full blocks are in the prefix cache; then the other samples start and take
those blocks by reference (prefix-cache routing sends them back to the worker that holds
them), each computing only the prompt's last, partial block before it diverges. Every
sample is an ordinary request with its own driver, penalties and stop strings. A seeded
request's sample i is seeded with seed + i, so sample 0 is the request's n=1 answer.

`best_of` samples that many and returns the `n` whose tokens have the highest summed
logprob (vLLM's ranking, of the raw distribution); it cannot be streamed (as in vLLM).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

from pdserve.router import responses
from pdserve.router.delta import Delta
from pdserve.router.driver import RequestDriver
from pdserve.router.echo import Echo
from pdserve.router.protocol import ApiError, ApiRequest
from pdserve.sampling_params import SamplingParams


@dataclasses.dataclass
class Choice:
    driver: RequestDriver
    text: list[str] = dataclasses.field(default_factory=list)
    entries: list[list[Any]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    echo: Echo | None = None  # the request's, shared by its choices (router/echo.py)

    def deltas(self) -> AsyncIterator[Delta]:
        stream = self.driver.stream()
        return stream if self.echo is None else self.echo.wrap(stream)

    def add(self, delta: Delta) -> None:
        self.text.append(delta.text)
        self.entries += delta.logprobs or []
        self.finish_reason = delta.finish_reason or self.finish_reason

    @property
    def score(self) -> float:
        # An echoed prompt's entries are every choice's: the first one's None is skipped.
        return sum(logprob for _, logprob, _ in self.entries if logprob is not None)


def sample_params(params: SamplingParams, index: int, ranked: bool) -> SamplingParams:
    """Sample `index`'s params: its own seed, and logprobs when `best_of` ranks by them.
    Only the first scores an echoed prompt (the others take its blocks from the cache)."""
    seed = None if params.seed is None else params.seed + index
    logprobs = 0 if ranked and params.logprobs is None else params.logprobs
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return dataclasses.replace(
        params, seed=seed, logprobs=logprobs, prompt_logprobs=prompt_logprobs
    )


async def run_choices(
    request: web.Request,
    api: ApiRequest,
    ctx: responses.ResponseContext,
    params: SamplingParams,
    make_driver: Callable[[SamplingParams, str], RequestDriver],
    on_end: Callable[[list[RequestDriver], str], None],
    write_timeout_s: float,
    echo: Echo | None = None,
) -> web.StreamResponse:
    """Answer a request for `api.best_of` samples of which `api.n` are returned.
    `make_driver(params, key)` builds a sample's driver; `on_end(drivers, status)` records
    the outcome (the caller's metrics) once every driver is closed; `echo` puts the prompt
    before every choice."""
    if getattr(api, "tools", None) is not None:  # its parsed calls are one choice's
        raise ApiError(400, "n > 1 is not supported with tools", param="n")
    num_samples, ranked = api.best_of or api.n, (api.best_of or api.n) > api.n
    choices = [
        Choice(make_driver(sample_params(params, i, ranked), ctx.id if i == 0 else f"{ctx.id}-{i}"))
        for i in range(num_samples)
    ]
    for choice in choices:
        choice.echo = echo

    async def answer() -> tuple[web.StreamResponse, ApiError | None]:
        if api.stream:
            return await _stream(request, api, ctx, choices, write_timeout_s)
        return await _whole(ctx, api, choices, params.logprobs is not None), None

    def end(status: str) -> None:
        for choice in choices:
            choice.driver.close(status)
        on_end([c.driver for c in choices], status)

    return await answer_recorded(answer(), end)


async def answer_recorded(
    answer: Awaitable[tuple[web.StreamResponse, ApiError | None]], end: Callable[[str], None]
) -> web.StreamResponse:
    """Await `answer` (the response and the error it streamed, if any) and call `end` with
    the request's outcome, a metrics label, however it ends: success, cancelled (the client
    left), rejected (503), invalid (4xx) or failed."""
    status = "failed"
    try:
        response, error = await answer
        status = "success" if error is None else _status_of(error)
        return response
    except (asyncio.CancelledError, ConnectionResetError):
        status = "cancelled"
        raise
    except ApiError as exc:
        status = _status_of(exc)
        raise
    finally:
        end(status)


def _status_of(error: ApiError) -> str:
    return "rejected" if error.status == 503 else "invalid" if error.status < 500 else "failed"


async def _deltas(choices: list[Choice]) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, delta) as they come: the first sample's first delta before any other
    sample starts (its prompt is then cached), then all samples side by side."""
    streams = [c.deltas() for c in choices]
    yield 0, await anext(streams[0])
    queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            async for delta in streams[index]:
                await queue.put((index, delta))
            await queue.put((index, None))
        except BaseException as exc:  # handed to the reader, which raises it
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(streams))]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _whole(
    ctx: responses.ResponseContext, api: ApiRequest, choices: list[Choice], wants_logprobs: bool
) -> web.StreamResponse:
    async for index, delta in _deltas(choices):
        choices[index].add(delta)
    kept = choices
    if len(choices) > api.n:  # best_of: the n likeliest, in order of likelihood
        kept = sorted(choices, key=lambda c: c.score, reverse=True)[: api.n]
    out: dict[str, Any] = {}
    for index, choice in enumerate(kept):
        logprobs = ctx.format_logprobs(choice.entries) if wants_logprobs else None
        text = "".join(choice.text)
        body = responses.body(ctx, text, choice.finish_reason, stream=False, logprobs=logprobs)
        body["choices"][0]["index"] = index
        out = out or body
        out["choices"] = [*out["choices"], *body["choices"]] if index else body["choices"]
    out["usage"] = usage(choices)
    return web.json_response(out, headers={"X-Request-Id": ctx.id})


async def _stream(
    request: web.Request,
    api: ApiRequest,
    ctx: responses.ResponseContext,
    choices: list[Choice],
    write_timeout_s: float,
) -> tuple[web.StreamResponse, ApiError | None]:
    """SSE with each chunk's choice `index`; a choice's first chunk carries the chat role.
    A failure after the headers is an error event before [DONE]."""
    deltas = _deltas(choices)
    first = await anext(deltas)
    response = responses.EventStream(write_timeout_s)
    response.headers["X-Request-Id"] = ctx.id
    await response.prepare(request)
    started: set[int] = set()
    formatters = [dataclasses.replace(ctx, logprobs=_copy(ctx.logprobs)) for _ in choices]

    async def write(index: int, delta: Delta) -> None:
        choice_ctx = formatters[index]
        logprobs = choice_ctx.format_logprobs(delta.logprobs or [])
        body = responses.body(
            ctx,
            delta.text,
            delta.finish_reason,
            stream=True,
            first=index not in started,
            logprobs=logprobs,
        )
        started.add(index)
        body["choices"][0]["index"] = index
        await response.write(responses.sse(body))

    error = None
    try:
        await write(*first)
        async for index, delta in deltas:
            await write(index, delta)
    except ApiError as exc:
        await response.write(responses.sse(exc.body()))
        error = exc
    if api.include_usage and error is None:
        await response.write(
            responses.sse(responses.body(ctx, None, stream=True, usage=usage(choices)))
        )
    await response.write(responses.SSE_DONE)
    await response.write_eof()
    return response, error


def _copy(formatter: Any) -> Any:
    """A choice's own logprobs formatter (completions' text_offset runs per choice)."""
    return None if formatter is None else type(formatter)(formatter.tokenizer, formatter.chat)


def usage(choices: list[Choice]) -> dict[str, Any]:
    """The prompt once (cached as the first sample found it), every sample's tokens
    (best_of's unreturned ones too: they were computed)."""
    first = choices[0].driver
    num_completion = sum(c.driver.num_output_tokens for c in choices)
    return responses.usage(len(first.prompt_token_ids), num_completion, first.num_cached_tokens)
