"""The HTTP app: routes, health, metrics, auth, error JSON; `serve` for the process.

Handlers run with aiohttp's handler cancellation on, so a client that disconnects cancels its
handler wherever it is waiting, and the driver's `close()` (in a `finally`) aborts the request
on every worker at once.

Slow clients cost a socket for a bounded time and never a request slot (README "Security
model"): the request head must arrive within `head_timeout_s` (aiohttp's keep-alive timer,
which runs from connect to a complete head), the body within `body_timeout_s` and before the
handler takes a slot, and each response write must drain within `write_timeout_s`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
from pathlib import Path
from typing import Any

from aiohttp import web

from pdserve.model.tokenizer import Tokenizer, load_tokenizer
from pdserve.output_processor import OutputProcessor
from pdserve.router.adaptive_planner import Planner
from pdserve.router.completions import STATE, RouterState, chat_completions, completions
from pdserve.router.config import RouterConfig
from pdserve.router.control_plane import ControlPlane
from pdserve.router.policies import make_policy
from pdserve.router.protocol import ApiError
from pdserve.router.responses import bounded
from pdserve.router.scope import TENANT, tenant_of
from pdserve.router.status import History, add_routes, worker_rows
from pdserve.router.warmup import unpin, warmup

log = logging.getLogger(__name__)
_OPS_PATHS = ("/health", "/metrics", "/v1/status")  # public unless `protect_health_metrics`
_ADMIN_PATHS = ("/v1/cache/warmup",)  # the admin key, never the API key


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
    policy = make_policy(config.policy, config.load_balancer)
    state = RouterState(config, tokenizer, plane, policy, OutputProcessor(tokenizer))
    app = web.Application(
        client_max_size=config.max_body_bytes, middlewares=[_errors, _auth, _limits]
    )
    app[STATE] = state

    if config.adaptive.enabled:
        plane.planner = Planner(config.adaptive, plane, state.metrics.adaptive)

    async def run_plane(_: web.Application):  # a cleanup context: runs while the app does
        await plane.start()
        if plane.planner is not None:
            await plane.planner.start()
        yield
        if plane.planner is not None:
            await plane.planner.close()
        await plane.close()

    app.cleanup_ctx.append(run_plane)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/cache/warmup", warmup)
    app.router.add_delete("/v1/cache/warmup", unpin)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    add_routes(app, History())
    return app


async def start_server(app: web.Application) -> tuple[web.AppRunner, int]:
    """Serve `app` on its config's host and port; returns the runner and the bound port
    (port 0 picks a free one, which tests use)."""
    config = app[STATE].config
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, keepalive_timeout=config.head_timeout_s
    )
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    port = runner.addresses[0][1]
    log.info("router serving %s on http://%s:%d", config.model, config.host, port)
    return runner, port


async def serve(config: RouterConfig) -> None:
    """Run the router until SIGTERM or SIGINT, then clean up (sockets, open responses)."""
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    runner, _ = await start_server(build_app(config))
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every error leaves as OpenAI error JSON; nothing escapes as a traceback."""
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc)
    except ConnectionResetError:
        # The client left mid-write: nothing to answer; aiohttp treats this as a disconnect.
        raise asyncio.CancelledError from None
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
    """The admin paths need the admin key (and are refused when there is none). With an
    api_key every other path needs one of its keys (unknown ones too: no probing for routes),
    except the dashboard's files (the same for everyone, holding no data: the page asks
    /v1/status, with the key when one is set), and /health, /metrics and /v1/status unless
    `protect_health_metrics`. With cache_scope "tenant" the key's tenant is noted for the
    request's cache scope (router/scope.py)."""
    config = request.app[STATE].config
    public = () if config.protect_health_metrics else _OPS_PATHS
    is_asset = (request.path + "/").startswith("/dashboard/")
    if request.path in _ADMIN_PATHS:
        if not config.admin_key:
            message = "cache warm-up is disabled: the router has no admin key (admin_key)"
            raise ApiError(403, message, type="permission_error", code="no_admin_key")
        if not _bearer_is(request, config.admin_key):
            raise ApiError(401, "invalid or missing admin key", code="invalid_admin_key")
    elif config.api_key and request.path not in public and not is_asset:
        # Every key is compared, so the time taken does not tell which one matched.
        matches = [key for key in config.api_keys if _bearer_is(request, key)]
        if not matches:
            raise ApiError(401, "invalid or missing API key", code="invalid_api_key")
        if config.cache_scope == "tenant":
            request[TENANT] = tenant_of(matches[0])
    return await handler(request)


def _bearer_is(request: web.Request, key: str) -> bool:
    # aiohttp keeps header bytes that are not UTF-8 as surrogate escapes: compare bytes.
    given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, f"Bearer {key}".encode())


@web.middleware
async def _limits(request: web.Request, handler: Any) -> web.StreamResponse:
    """Read the whole body within `body_timeout_s` before the handler runs (and takes a
    request slot); write a non-streamed response within `write_timeout_s` (EventStream
    bounds streamed ones). A body too slow ends the connection after the reply: aiohttp would
    otherwise linger, draining the rest of it, for up to 10 s more. A body too large is
    drained so (the client, still uploading, reads the 413 instead of a broken pipe)."""
    config = request.app[STATE].config
    if request.body_exists:
        try:
            declared = request.content_length or 0
            if declared > config.max_body_bytes:
                raise web.HTTPRequestEntityTooLarge(config.max_body_bytes, declared)
            async with asyncio.timeout(config.body_timeout_s):
                await request.read()  # kept by aiohttp: the handler's read() returns it
        except (TimeoutError, web.HTTPRequestEntityTooLarge) as exc:
            late = isinstance(exc, TimeoutError)
            if late:
                limit = f"not received within {config.body_timeout_s} s (body_timeout_s)"
                error = ApiError(408, f"request body {limit}")
            else:
                limit = f"over {config.max_body_bytes} bytes (max_body_bytes)"
                error = ApiError(413, f"Request Entity Too Large: the body is {limit}")
            response = await _send(request, error_response(error), config.write_timeout_s)
            if late and request.transport is not None:
                request.transport.close()  # after the reply is flushed
            return response
    return await _send(request, await handler(request), config.write_timeout_s)


async def _send(
    request: web.Request, response: web.StreamResponse, timeout_s: float
) -> web.StreamResponse:
    async def send() -> None:
        await response.prepare(request)
        await response.write_eof()

    if not response.prepared:
        await bounded(request, send(), timeout_s)
    return response


def error_response(error: ApiError) -> web.Response:
    headers = {}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(error.retry_after_s)
    return web.json_response(error.body(), status=error.status, headers=headers)


async def _models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    model = {"id": state.config.model, "object": "model", "created": 0, "owned_by": "pdserve"}
    model["max_model_len"] = state.plane.max_model_len()
    return web.json_response({"object": "list", "data": [model]})


async def _health(request: web.Request) -> web.Response:
    ok, detail = request.app[STATE].plane.health()
    return web.json_response(detail, status=200 if ok else 503)


async def _metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    text = state.metrics.render(worker_rows(state), state.num_pending)
    return web.Response(text=text, content_type="text/plain", charset="utf-8")
