"""The HTTP front: OpenAI routes, SSE streaming, health, metrics, auth and backpressure.

Handlers run with aiohttp's handler cancellation on, so a client that disconnects cancels its
handler wherever it is waiting, and the driver's `close()` (in a `finally`) aborts the request
on every worker at once.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from pdserve.model.tokenizer import Tokenizer, load_tokenizer
from pdserve.output_processor import OutputProcessor
from pdserve.router import responses
from pdserve.router.config import RouterConfig
from pdserve.router.driver import RequestDriver
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policies import RoutingPolicy, make_policy
from pdserve.router.protocol import ApiError, ApiRequest, finalize_sampling, parse_request
from pdserve.router.workers import ControlPlane

log = logging.getLogger(__name__)


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


def load_router_tokenizer(config: RouterConfig) -> Tokenizer:
    """A tokenizer-only directory is used as is; anything else goes through the model
    registry (known names and .gguf files are converted into the cache once)."""
    path = Path(config.tokenizer_source).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return Tokenizer(path)
    return load_tokenizer(config.tokenizer_source)


def build_app(config: RouterConfig, tokenizer: Tokenizer | None = None) -> web.Application:
    tokenizer = tokenizer or load_router_tokenizer(config)
    plane = ControlPlane(config)
    state = RouterState(
        config, tokenizer, plane, make_policy(config.policy), OutputProcessor(tokenizer)
    )
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[_errors, _auth])
    app[STATE] = state

    async def start(_: web.Application) -> None:
        await plane.start()

    async def stop(_: web.Application) -> None:
        await plane.close()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    return app


async def start_server(app: web.Application) -> tuple[web.AppRunner, int]:
    """Serve `app` on its config's host and port; returns the runner and the bound port
    (port 0 picks a free one, which tests use)."""
    config = app[STATE].config
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    port = runner.addresses[0][1]
    log.info("router serving %s on http://%s:%d", config.model, config.host, port)
    return runner, port


async def serve(config: RouterConfig) -> None:
    """Run the router until cancelled."""
    runner, _ = await start_server(build_app(config))
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


# ---- middlewares --------------------------------------------------------------------------


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every error leaves as OpenAI error JSON; nothing escapes as a traceback."""
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        return error_response(ApiError(exc.status, exc.reason, type=kind))
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(ApiError(500, "internal server error", type="server_error"))


@web.middleware
async def _auth(request: web.Request, handler: Any) -> web.StreamResponse:
    api_key = request.app[STATE].config.api_key
    if api_key and request.path.startswith("/v1"):
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise ApiError(401, "invalid or missing API key", code="invalid_api_key")
    return await handler(request)


def error_response(error: ApiError) -> web.Response:
    headers = {}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(error.retry_after_s)
    return web.json_response(error.body(), status=error.status, headers=headers)


# ---- routes -------------------------------------------------------------------------------


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def _models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    model = {
        "id": state.config.model,
        "object": "model",
        "created": 0,
        "owned_by": "pdserve",
        "max_model_len": state.plane.max_model_len(),
    }
    return web.json_response({"object": "list", "data": [model]})


async def _health(request: web.Request) -> web.Response:
    ok, detail = request.app[STATE].plane.health()
    return web.json_response(detail, status=200 if ok else 503)


async def _metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    rows = []
    for w in state.plane.workers.values():
        s = w.stats
        rows.append(
            {
                "worker": w.worker_id,
                "healthy": int(state.plane.is_healthy(w.worker_id)),
                "num_waiting": s.num_waiting if s else 0,
                "num_running": s.num_running if s else 0,
                "num_free_blocks": s.num_free_blocks if s else 0,
                "num_total_blocks": s.num_total_blocks if s else 0,
                "kv_bytes_sent": s.kv_bytes_sent if s else 0,
                "kv_bytes_received": s.kv_bytes_received if s else 0,
            }
        )
    text = state.metrics.render(rows, state.num_pending)
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    if state.num_pending >= state.config.max_pending:
        state.metrics.requests["rejected"] += 1
        raise ApiError(
            429,
            "too many requests in flight; retry later",
            type="rate_limit_error",
            retry_after_s=1,
        )
    state.num_pending += 1
    try:
        try:
            api = parse_request(
                await _read_json(request), chat, state.config.model, state.config.max_tokens_limit
            )
            prompt_ids = _tokenize(state, api)
            params = finalize_sampling(api, len(prompt_ids), state.plane.max_model_len())
        except ApiError:
            state.metrics.requests["invalid"] += 1
            raise
        driver = RequestDriver(
            state.plane,
            state.policy,
            state.processor,
            prompt_ids,
            params,
            state.config.admission_timeout_s,
        )
        return await _run(request, state, api, driver, len(prompt_ids))
    finally:
        state.num_pending -= 1


async def _run(
    request: web.Request,
    state: RouterState,
    api: ApiRequest,
    driver: RequestDriver,
    num_prompt_tokens: int,
) -> web.StreamResponse:
    """Drive one request and answer it, recording its outcome however it ends."""
    ctx = responses.ResponseContext(api.chat, state.config.model)
    status = "failed"
    try:
        if api.stream:
            response, error = await _stream(request, api, driver, ctx, num_prompt_tokens)
            if error is not None:
                status = "rejected" if error.status == 503 else "failed"
                return response
        else:
            text, finish_reason = [], None
            async for delta in driver.stream():
                text.append(delta.text)
                finish_reason = delta.finish_reason
            usage = responses.usage(num_prompt_tokens, driver.num_output_tokens)
            body = responses.full_response(ctx, "".join(text), finish_reason, usage)
            response = web.json_response(body)
        status = "success"
        return response
    except (asyncio.CancelledError, ConnectionResetError):
        status = "cancelled"
        raise
    except ApiError as exc:
        status = "rejected" if exc.status == 503 else "failed"
        raise
    finally:
        driver.close(status)
        state.metrics.requests[status] += 1
        if status == "success":
            e2e_s = time.monotonic() - driver.arrival
            state.metrics.record_finished(
                driver.ttft_s, e2e_s, num_prompt_tokens, driver.num_output_tokens
            )


async def _stream(
    request: web.Request,
    api: ApiRequest,
    driver: RequestDriver,
    ctx: responses.ResponseContext,
    num_prompt_tokens: int,
) -> tuple[web.StreamResponse, ApiError | None]:
    """SSE. Headers go out with the first token, so admission errors (503, 400) are still
    plain HTTP errors; a failure after that becomes an error event before [DONE] (and is
    returned, the status line being long gone)."""
    deltas = driver.stream()
    first = await anext(deltas)
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    await response.write(
        responses.sse(responses.chunk(ctx, first.text, first.finish_reason, first=True))
    )
    try:
        async for delta in deltas:
            await response.write(
                responses.sse(responses.chunk(ctx, delta.text, delta.finish_reason))
            )
    except ApiError as exc:
        await response.write(responses.sse(exc.body()))
        await response.write(responses.SSE_DONE)
        await response.write_eof()
        return response, exc
    if api.include_usage:
        usage = responses.usage(num_prompt_tokens, driver.num_output_tokens)
        await response.write(responses.sse(responses.usage_chunk(ctx, usage)))
    await response.write(responses.SSE_DONE)
    await response.write_eof()
    return response, None


async def _read_json(request: web.Request) -> Any:
    raw = await request.read()  # over client_max_size: aiohttp raises 413
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ApiError(400, "request body is not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None


def _tokenize(state: RouterState, api: ApiRequest) -> list[int]:
    if api.chat:
        try:
            return state.tokenizer.apply_chat_template(api.messages or [])
        except ValueError as exc:
            raise ApiError(400, str(exc), param="messages") from None
    if isinstance(api.prompt, str):
        ids = state.tokenizer.encode(api.prompt)
        if not ids:
            raise ApiError(400, "prompt encodes to zero tokens", param="prompt")
        return ids
    assert api.prompt is not None
    vocab_size = state.tokenizer.vocab_size
    if any(t >= vocab_size for t in api.prompt):
        raise ApiError(400, f"prompt token ids must be < vocab size {vocab_size}", param="prompt")
    return list(api.prompt)
