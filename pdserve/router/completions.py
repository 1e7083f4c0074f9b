"""The generation routes (/v1/completions, /v1/chat/completions): parse, tokenize, drive,
answer as JSON or SSE, and record each request's outcome in the metrics."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from pdserve.model.tokenizer import Tokenizer
from pdserve.output_processor import OutputProcessor
from pdserve.router import protocol, responses
from pdserve.router.choices import answer_recorded, run_choices
from pdserve.router.config import RouterConfig
from pdserve.router.control_plane import ControlPlane
from pdserve.router.delta import Delta
from pdserve.router.driver import RequestDriver
from pdserve.router.echo import Echo, check_size
from pdserve.router.logprobs import LogprobsFormatter
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policies import RoutingPolicy
from pdserve.router.protocol import ApiError, ApiRequest
from pdserve.router.scope import TENANT, parse_cache_salt, scope_salt
from pdserve.router.timing import RequestTiming, export_span
from pdserve.router.tool_stream import rewrite_body, tool_deltas
from pdserve.router.tools import chat_input
from pdserve.sampling_params import SamplingParams

REQUEST_ID_HEADER = "X-Request-Id"  # on every generation response: the id in the logs
TIMING_HEADER = "X-PDServe-Timing"  # "1": the response carries `pdserve_timing`


@dataclass
class RouterState:
    config: RouterConfig
    tokenizer: Tokenizer
    plane: ControlPlane
    policy: RoutingPolicy
    processor: OutputProcessor
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    num_pending: int = 0


STATE = web.AppKey("router_state", RouterState)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    with request_slot(state):
        timing = RequestTiming()
        try:
            body = await read_json(request)
            api = protocol.parse_request(body, chat, state.config, state.tokenizer.chat_template)
            prompt_ids = await _tokenize(state, api)
            params = protocol.finalize_sampling(api, len(prompt_ids), state.plane.max_model_len())
            max_bytes = state.config.max_message_bytes
            check_size(len(prompt_ids), params.prompt_logprobs, max_bytes)
            cache_salt = scope_salt(request.get(TENANT, ""), parse_cache_salt(body))
        except ApiError:
            state.metrics.requests["invalid"] += 1
            raise
        ctx = responses.ResponseContext(api.chat, state.config.model)
        if params.logprobs is not None:
            ctx.logprobs = LogprobsFormatter(state.tokenizer, api.chat)

        def make_driver(params: SamplingParams, key: str) -> RequestDriver:
            timing_of = timing if key == ctx.id else RequestTiming()
            return RequestDriver(
                state.plane,
                state.policy,
                state.processor,
                prompt_ids,
                params,
                key,
                timing_of,
                state.metrics.fallbacks,
                cache_salt,
            )

        if api.n > 1 or api.best_of is not None:
            on_end = functools.partial(_record, state, ctx.id)
            timeout_s, echo = state.config.write_timeout_s, _echo(request, api, prompt_ids, params)
            return await run_choices(
                request, api, ctx, params, make_driver, on_end, timeout_s, echo
            )
        return await _run(request, api, ctx, make_driver(params, ctx.id))


@contextlib.contextmanager
def request_slot(state: RouterState) -> Iterator[None]:
    """One of `max_pending` slots for the handler's lifetime, or 429: every route that puts
    work on the workers (generation and warm-up) counts."""
    if state.num_pending >= state.config.max_pending:
        state.metrics.requests["rejected"] += 1
        message = "too many requests in flight; retry later"
        raise ApiError(429, message, type="rate_limit_error", retry_after_s=1)
    state.num_pending += 1
    try:
        yield
    finally:
        state.num_pending -= 1


async def _run(
    request: web.Request, api: ApiRequest, ctx: responses.ResponseContext, driver: RequestDriver
) -> web.StreamResponse:
    """Drive one request and answer it, recording its outcome however it ends."""
    state = request.app[STATE]

    def end(status: str) -> None:
        driver.close(status)
        _record(state, ctx.id, [driver], status)

    answer = (_stream if api.stream else _whole)(request, api, driver, ctx)
    return await answer_recorded(answer, end)


def _record(state: RouterState, key: str, drivers: list[RequestDriver], status: str) -> None:
    """A request's outcome in the metrics; its samples' tokens count together (`n`)."""
    state.metrics.requests[status] += 1
    timing = drivers[0].timing
    export_span(key, timing, status)
    if status == "success":
        state.metrics.record_finished(
            timing.ttft_s,
            time.monotonic() - timing.arrival,
            len(drivers[0].prompt_token_ids),
            sum(d.num_output_tokens for d in drivers),
            timing.itl_s,
            timing.parts(),
        )


async def _whole(
    request: web.Request, api: ApiRequest, driver: RequestDriver, ctx: responses.ResponseContext
) -> tuple[web.StreamResponse, None]:
    text, finish_reason, entries = [], None, []
    async for delta in _deltas(request, api, driver):
        text.append(delta.text)
        finish_reason = delta.finish_reason
        entries += delta.logprobs or []
    body = responses.body(
        ctx,
        "".join(text),
        finish_reason,
        stream=False,
        usage=_usage(driver),
        logprobs=ctx.format_logprobs(entries),
    )
    if api.tools is not None and api.tools.parses:
        rewrite_body(body, api.tools, request.app[STATE].metrics.tool_call_parse_failures.inc)
    if _wants_timing(request):
        body["pdserve_timing"] = driver.timing.report(ctx.id)
    return web.json_response(body, headers={REQUEST_ID_HEADER: ctx.id}), None


async def _stream(
    request: web.Request, api: ApiRequest, driver: RequestDriver, ctx: responses.ResponseContext
) -> tuple[web.StreamResponse, ApiError | None]:
    """SSE. Headers go out with the first token, so admission errors (503, 400) are still
    plain HTTP errors; a failure after that becomes an error event before [DONE] (and is
    returned, the status line being long gone)."""
    deltas = _deltas(request, api, driver)
    if api.tools is not None and api.tools.parses:
        failures = request.app[STATE].metrics.tool_call_parse_failures
        deltas = tool_deltas(api.tools, deltas, failures.inc)
    first = await anext(deltas)
    response = responses.EventStream(request.app[STATE].config.write_timeout_s)
    response.headers[REQUEST_ID_HEADER] = ctx.id
    await response.prepare(request)
    timing = driver.timing if _wants_timing(request) else None
    await response.write(_chunk(ctx, first, timing, first=True))
    error = None
    try:
        async for delta in deltas:
            await response.write(_chunk(ctx, delta, timing))
    except ApiError as exc:
        await response.write(responses.sse(exc.body()))
        error = exc
    if api.include_usage and error is None:
        usage = responses.body(ctx, None, stream=True, usage=_usage(driver))
        await response.write(responses.sse(usage))
    await response.write(responses.SSE_DONE)
    await response.write_eof()
    return response, error


def _chunk(
    ctx: responses.ResponseContext, delta: Any, timing: RequestTiming | None, first: bool = False
) -> bytes:
    """One SSE chunk; the last carries `pdserve_timing` when the client asked for it."""
    tool_calls = getattr(delta, "tool_calls", None)
    extras = first or delta.finish_reason or delta.logprobs or ctx.logprobs is not None
    if not (extras or tool_calls):  # a token's chunk: text alone
        return ctx.text_chunk(delta.text)
    logprobs = ctx.format_logprobs(delta.logprobs or [])
    body = responses.body(
        ctx, delta.text, delta.finish_reason, stream=True, first=first, logprobs=logprobs
    )
    if tool_calls:
        body["choices"][0]["delta"]["tool_calls"] = tool_calls
    if timing is not None and delta.finish_reason is not None:
        body["pdserve_timing"] = timing.report(ctx.id)
    return responses.sse(body)


def _deltas(request: web.Request, api: ApiRequest, driver: RequestDriver) -> AsyncIterator[Delta]:
    """The driver's deltas, the prompt echoed before them when asked (router/echo.py)."""
    echo = _echo(request, api, driver.prompt_token_ids, driver.params)
    return driver.stream() if echo is None else echo.wrap(driver.stream())


def _echo(
    request: web.Request, api: ApiRequest, prompt_ids: list[int], params: SamplingParams
) -> Echo | None:
    if not api.echo:
        return None
    scored = params.prompt_logprobs is not None
    return Echo(api, prompt_ids, request.app[STATE].tokenizer, scored)


def _usage(driver: RequestDriver) -> dict[str, Any]:
    num_prompt_tokens = len(driver.prompt_token_ids)
    return responses.usage(num_prompt_tokens, driver.num_output_tokens, driver.num_cached_tokens)


def _wants_timing(request: web.Request) -> bool:
    return request.headers.get(TIMING_HEADER, "").strip().lower() in ("1", "true", "yes")


async def read_json(request: web.Request) -> Any:
    return protocol.parse_json(await request.read())  # over client_max_size: aiohttp raises 413


async def _tokenize(state: RouterState, api: ApiRequest) -> list[int]:
    """Prompt ids, once the text is known to be short enough to possibly fit."""
    protocol.check_prompt_chars(api, state.tokenizer.max_token_chars, state.plane.max_model_len())
    protocol.check_token_ids(api, state.tokenizer.vocab_size)
    if isinstance(api.prompt, list):
        vocab_size = state.tokenizer.vocab_size
        if any(t >= vocab_size for t in api.prompt):
            message = f"prompt token ids must be < vocab size {vocab_size}"
            raise ApiError(400, message, param="prompt")
        return list(api.prompt)
    if api.chat:
        messages, tools = chat_input(api.tools, api.messages or [])
        return await tokenize(state.tokenizer, messages, "messages", tools)
    return await tokenize(state.tokenizer, api.prompt or "", "prompt")


async def tokenize(
    tokenizer: Tokenizer,
    prompt: str | list[dict[str, Any]],
    param: str,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Text or chat messages (and `tools`, for a template that renders them) as ids, tokenized
    off the event loop (the HF tokenizer releases the GIL), or a 400 naming `param`: the
    template refused them, or they encode to nothing."""
    encode = tokenizer.encode
    if not isinstance(prompt, str):
        encode = functools.partial(tokenizer.apply_chat_template, tools=tools)
    try:
        ids = await asyncio.to_thread(encode, prompt)
    except ValueError as exc:
        raise ApiError(400, f"{param}: {exc}", param=param) from None
    if not ids:
        raise ApiError(400, f"{param} encodes to zero tokens", param=param)
    return ids
