"""Cache warm-up routes (README "Security model", docs/ARCHITECTURE.md "KV cache layout"):
`POST /v1/cache/warmup` prefills and pins prompts on every healthy prefill and collocated
worker (whichever a later request is routed to then hits), `DELETE` unpins them.

    {"model": "...", "prompts": ["...", ...], "messages": [[{"role", "content"}, ...], ...],
     "pin": true, "shared": false}
    -> {"object": "cache.warmup", "pin": true, "shared": false, "workers": {"p0": [{"index": 0,
        "num_prompt_tokens": 30, "num_cached_tokens": 16, "num_pinned_tokens": 16}, ...]}}

Cache scopes (router/scope.py): a warm-up is made in the default scope, hit only by requests
hashed there (every request when no API key is configured, else none with a key in
cache_scope "tenant", nor any with a `cache_salt`), unless the operator says `"shared": true`:
then it is made in the shared scope, which every request reads (after its own) and none
writes. Unpin with the same `shared` as the warm-up.

A worker that is not healthy, fails or refuses (e.g. its pinned share is full) gets an `error`
entry per prompt, so a caller sees who was not warmed; the others still answer (200). With
no healthy prefill-capable worker at all the answer is 503.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from aiohttp import web

from pdserve import messages
from pdserve.kvcache.hashing import SHARED_SCOPE
from pdserve.request import WARMUP_PARAMS
from pdserve.router import protocol
from pdserve.router.completions import STATE, RouterState, read_json, request_slot, tokenize
from pdserve.router.control_plane import WorkerLost
from pdserve.router.protocol import ApiError, check_model, parse_messages, too_long

WARMUP_ROLES = ("prefill", "collocated")
_WARMUP_SAMPLING = protocol.sampling_to_wire(WARMUP_PARAMS)
_NOT_HEALTHY = {"error": "worker not healthy (not ready, or lost): not warmed"}


async def warmup(request: web.Request) -> web.Response:
    return await _warm(request, unpin=False)


async def unpin(request: web.Request) -> web.Response:
    return await _warm(request, unpin=True)


async def _warm(request: web.Request, unpin: bool) -> web.Response:
    state, config = request.app[STATE], request.app[STATE].config
    with request_slot(state):
        body = await read_json(request)
        prompts, pin, shared = parse_warmup(body, config.model, config.max_warmup_prompts)
        prompt_ids = [await _tokenize(state, prompt, param) for prompt, param in prompts]
        num_tokens = sum(map(len, prompt_ids))
        if num_tokens > config.max_warmup_tokens:
            message = (
                f"prompts and messages have {num_tokens} tokens together; at most "
                f"{config.max_warmup_tokens} per warm-up call (max_warmup_tokens)"
            )
            raise ApiError(400, message, param="prompts")
        worker_ids = [w.worker_id for w in state.plane.workers.values() if w.role in WARMUP_ROLES]
        healthy = [wid for wid in worker_ids if state.plane.is_healthy(wid)]
        if not healthy:
            message = "no healthy prefill or collocated worker to warm"
            raise ApiError(503, message, type="server_error")
        pin = pin and not unpin
        salt = SHARED_SCOPE if shared else ""
        asks = [_ask(state, wid, ids, pin, unpin, salt) for wid in healthy for ids in prompt_ids]
        answers = iter(await asyncio.gather(*asks))
    workers = {
        wid: [
            {"index": i, **(next(answers) if wid in healthy else _NOT_HEALTHY)}
            for i in range(len(prompt_ids))
        ]
        for wid in worker_ids
    }
    state.metrics.warmup_calls.labels("unpin" if unpin else "pin").inc()
    pinned = [r.get("num_pinned_tokens", 0) for rows in workers.values() for r in rows]
    if pin:
        state.metrics.warmup_pinned_tokens.inc(sum(pinned))
    answer = {"object": "cache.warmup", "pin": pin, "shared": shared, "workers": workers}
    return web.json_response(answer)


def parse_warmup(
    body: Any, served_model: str, max_prompts: int
) -> tuple[list[tuple[Any, str]], bool, bool]:
    """(prompt, param name) pairs, texts first, then message lists; the pin and shared
    flags."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    check_model(body.get("model", served_model), served_model)
    pin = body.get("pin", True)
    if not isinstance(pin, bool):
        raise ApiError(400, f"pin must be a boolean, got {pin!r}", param="pin")
    shared = body.get("shared", False)
    if not isinstance(shared, bool):
        raise ApiError(400, f"shared must be a boolean, got {shared!r}", param="shared")
    texts = body.get("prompts") or []
    if not isinstance(texts, list) or not all(isinstance(p, str) and p for p in texts):
        raise ApiError(400, "prompts must be a list of non-empty strings", param="prompts")
    chats = body.get("messages") or []
    if not isinstance(chats, list) or not all(isinstance(c, list) for c in chats):
        raise ApiError(400, "messages must be a list of message lists", param="messages")
    prompts = [(p, f"prompts[{i}]") for i, p in enumerate(texts)]
    for i, chat in enumerate(chats):
        try:
            prompts.append((parse_messages({"messages": chat}), f"messages[{i}]"))
        except ApiError as exc:
            raise ApiError(400, f"messages[{i}]: {exc.message}", param=f"messages[{i}]") from None
    if not prompts:
        raise ApiError(400, "give prompts and/or messages to warm", param="prompts")
    if len(prompts) > max_prompts:
        message = f"at most {max_prompts} prompts per call (max_warmup_prompts), got {len(prompts)}"
        raise ApiError(400, message, param="prompts")
    return prompts, pin, shared


async def _tokenize(state: RouterState, prompt: str | list[dict], param: str) -> list[int]:
    ids = await tokenize(state.tokenizer, prompt, param)
    max_len = state.plane.max_model_len()
    if max_len is not None and len(ids) >= max_len:
        raise too_long(max_len, f"{param} has {len(ids)} tokens", param)
    return ids


async def _ask(
    state: RouterState,
    worker_id: str,
    prompt_ids: list[int],
    pin: bool,
    unpin: bool,
    cache_salt: str,
) -> dict[str, Any]:
    """One prompt on one worker: its warm-up (or Unpin) counts, or {"error": ...}. A client
    that goes away, or a warm-up past its deadline, aborts the prefill on the worker."""
    plane, request_id = state.plane, f"warmup-{uuid.uuid4().hex[:16]}"
    queue = plane.open(request_id)
    done = False
    try:
        if unpin:
            message = messages.Unpin(request_id, prompt_ids, cache_salt)
        else:
            message = messages.Generate(
                request_id, prompt_ids, _WARMUP_SAMPLING, pin=pin, cache_salt=cache_salt
            )
        if not plane.send(worker_id, message):
            done = True
            return {"error": f"cannot reach worker {worker_id}"}
        async with asyncio.timeout(state.config.warmup_timeout_s):
            while True:
                reply = await queue.get()
                if isinstance(reply, WorkerLost) and reply.worker_id != worker_id:
                    continue
                done = True
                return _answer(reply)
    except TimeoutError:
        return {"error": f"no answer within {state.config.warmup_timeout_s:.0f} s"}
    finally:
        plane.close_request(request_id)
        if not done and not unpin:
            plane.send(worker_id, messages.Abort(request_id))


def _answer(reply: Any) -> dict[str, Any]:
    if isinstance(reply, messages.Tokens | messages.Unpinned):
        pinned = getattr(reply, "num_pinned_tokens", None)
        return {
            "num_prompt_tokens": reply.num_prompt_tokens,
            "num_cached_tokens": reply.num_cached_tokens,
            "num_pinned_tokens": reply.num_unpinned_tokens if pinned is None else pinned,
        }
    if isinstance(reply, WorkerLost):
        return {"error": f"worker lost: {reply.reason}"}
    if isinstance(reply, (messages.Rejected, messages.Failed)):
        return {"error": getattr(reply, "reason", None) or getattr(reply, "error", "failed")}
    return {"error": f"unexpected {type(reply).__name__}"}
