"""One request's journey through the workers: a small state machine per request, re-driven
when a worker fails under it.

    collocated:     queued ─Generate──────────────────────────────▶ decoding ─▶ finished
    disaggregated:  queued ─Reserve(D)─▶ reserved ─Prefill(P)─▶ prefilling
                           ─first token─▶ prefilled ─StartDecode(D)─▶ transferring
                           ─D's first token─▶ decoding ─▶ finished
    any state ─worker lost / Failed─▶ recovering ─▶ (a new attempt, below)
    any state ─▶ aborted (client gone, stop string) | failed (nothing can serve it)

Recovery. Each attempt has a fresh worker-side request id (a receiver must never confuse an
old attempt's late writes with a new one's), and the old attempt is aborted on every worker.
  - No token streamed yet: start over (Reserve on a D again, Prefill on a healthy P); with
    no healthy P, a decode worker prefills locally (`Generate`).
  - Tokens already streamed: `Generate(prompt, output_token_ids=streamed)` on a decode (or
    collocated, or as a last resort prefill) worker, which recomputes them as prompt and
    continues. The stream goes on from the next token: no duplicate, none missing.
Deadlines: a worker's heartbeat comes from its own thread, so a frozen engine loop (a deadlock,
a hung kernel) still looks alive. A worker silent past `first_token_timeout_s` (dispatch to its
first Tokens) or `token_timeout_s` (between Tokens) counts as lost for the request, and is not
picked again for it (it may be frozen for every request), unless its heartbeat says it is
inside one engine step that began by then: that step may run `step_timeout_s`.
At most `max_recoveries` re-drives; then the last failure is the client's error (502), and
"no healthy worker of a role" is a 503 at once for a new request; a re-drive waits for one
within `admission_timeout_s`.

Invariants: nothing reaches P before D has reserved room (admission lives at D); every worker
that may still hold work for the attempt is in `outstanding` (or `senders`: a P whose KV is
still in flight) and gets an Abort from `close()`, which the server calls in a `finally`, so a
disconnect at any stage frees every side at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from pdserve import messages
from pdserve.output_processor import OutputProcessor
from pdserve.router.control_plane import ControlPlane, Tick, WorkerLost
from pdserve.router.delta import Delta
from pdserve.router.fallbacks import FallbackMetrics
from pdserve.router.policies import RoutingPolicy
from pdserve.router.protocol import ApiError, bad_gateway, sampling_to_wire, unavailable
from pdserve.router.routing import AdaptiveRequest, Lost, pick
from pdserve.router.timing import RequestTiming
from pdserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)

_TERMINAL_REASONS = ("stop", "length", "abort")
_POLL_S = 0.5  # how often a request waiting on admission checks that its workers are alive
_GENERATE_ROLES = ("collocated", "decode", "prefill")  # who can run a whole request


class RequestDriver:
    def __init__(
        self,
        plane: ControlPlane,
        policy: RoutingPolicy,
        processor: OutputProcessor,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        timing: RequestTiming,
        fallbacks: FallbackMetrics,
        cache_salt: str = "",
    ) -> None:
        self.plane, self.config, self.policy = plane, plane.config, policy
        self.processor, self.prompt_token_ids, self.params = processor, prompt_token_ids, params
        self.sampling = sampling_to_wire(params)
        self.num_recoveries = self.num_attempts = self.num_output_tokens = 0
        # The client's id, in every log line: the processor's key, and each attempt's
        # worker-side id is it plus the attempt's number.
        self.key = request_id
        self.request_id = ""  # the worker-side id of the current attempt
        self.state = "queued"
        self.timing, self.fallbacks, self.cache_salt = timing, fallbacks, cache_salt
        self.num_cached_tokens = 0  # prompt tokens the serving worker took from its cache
        self.outstanding: dict[str, int] = {}  # worker id -> epoch, may still hold work
        self.senders: dict[str, int] = {}  # prefill workers whose KV may still be in flight
        # worker id -> the charge of this request's prompt there, and its tokens
        self._prefill_charge: dict[str, tuple[tuple[int, int], int]] = {}
        self._queue: asyncio.Queue[Any] | None = None
        self._excluded: set[str] = set()  # refused for lack of room; retried after a backoff
        self._stalled: set[str] = set()  # missed a deadline: never picked again for this request
        self._decode_id, self._yielded = "", False
        self.adaptive = AdaptiveRequest(plane, self.key, cache_salt)  # no-ops unless adaptive
        processor.add_request(self.key, params.stop, params.min_tokens)

    async def stream(self) -> AsyncIterator[Delta]:
        """Text deltas until the request ends. Raises ApiError (503 no capacity, 400 refused,
        502 worker failure that recovery could not mend); the caller must call `close()`."""
        while True:
            try:
                async for delta in self._attempt():
                    yield delta
                return
            except Lost as lost:
                self._abort_attempt()
                self.fallbacks.redrives.labels(lost.worker_id, lost.reason).inc()
                self.num_recoveries += 1
                if self.num_recoveries > self.config.max_recoveries:
                    raise bad_gateway(str(lost)) from None
                log.warning(
                    "request %s: %s; re-driving it after %d tokens (recovery %d)",
                    self.key,
                    lost,
                    self.num_output_tokens,
                    self.num_recoveries,
                )
                self._transition("recovering")

    def close(self, status: str) -> None:
        """Abort whatever may still run, release routing charges. Synchronous on purpose:
        it runs in `finally` blocks of cancelled tasks."""
        self._abort_attempt()
        self.processor.remove(self.key)
        self._transition(status)

    async def _attempt(self) -> AsyncIterator[Delta]:
        roles = self._servable_roles()
        disaggregate = not self.num_output_tokens and {"prefill", "decode"} <= roles
        local_id = disaggregate and self.adaptive.local_prefill(self.policy, self.prompt_token_ids)
        if disaggregate and not local_id:
            worker_id, tokens = await self._disaggregated_first_token()
        else:
            worker_id, tokens = await self._generate_first_token(local_id or "")
            if not local_id:  # the adaptive planner's own choice is counted as its decision
                self.fallbacks.served_whole(self.plane, worker_id, self.num_output_tokens)
        delta = self._on_tokens(worker_id, tokens, is_prefill=self.state == "prefilled")
        if not self._yielded or delta.text or delta.finish_reason or delta.logprobs:
            self._yielded = True
            yield delta
        if delta.finish_reason is not None:
            return
        if self.state == "prefilled":
            if not tokens.token_ids:
                raise bad_gateway(f"prefill worker {worker_id} sent no token")
            start = messages.StartDecode(self.request_id, tokens.token_ids[-1])
            self._send(self._decode_id, start)
            self._transition("transferring")
            worker_id = self._decode_id
        while True:
            first = self.state == "transferring"  # D's first token: after the KV lands
            message = await self._next(watch=worker_id, first_token=first)
            if not isinstance(message, messages.Tokens) or message.worker_id in self.senders:
                raise bad_gateway(f"unexpected {type(message).__name__} from {message.worker_id}")
            if self.state != "decoding":
                if self.senders:
                    self.adaptive.on_landed(self.timing)
                self.senders.clear()  # D decodes: its KV has landed
                self._transition("decoding")
            delta = self._on_tokens(message.worker_id, message, is_prefill=False)
            if delta.text or delta.finish_reason or delta.logprobs:
                yield delta
            if delta.finish_reason is not None:
                return

    async def _generate_first_token(self, worker_id: str = "") -> tuple[str, messages.Tokens]:
        """The whole request on one worker: collocated, a decode worker prefilling locally (no
        healthy prefill worker, or the adaptive planner's `worker_id`), or a resumed request
        recomputing its streamed tokens. Roles are chosen again after a refusal (switches)."""
        deadline = time.monotonic() + self.config.admission_timeout_s
        done = list(self.processor.states[self.key].token_ids)
        while True:
            roles = self._servable_roles()
            role = next((r for r in _GENERATE_ROLES if r in roles), None)
            if role is None:
                healthy = self.plane.healthy_roles()
                if self.num_recoveries and not healthy and time.monotonic() < deadline:
                    # A re-drive with no healthy worker at all waits for one (a restart, a
                    # heartbeat held up by the failure) within the admission timeout rather
                    # than lose its stream; workers that missed this request's deadlines
                    # stay healthy, and waiting would not bring them back.
                    await asyncio.sleep(0.05)
                    continue
                if healthy:
                    raise unavailable("every healthy worker missed a deadline for this request")
                raise unavailable("no healthy worker can serve the request")
            self._new_attempt()
            chosen = worker_id not in self._stalled and self.plane.is_healthy(worker_id)
            worker_id = self._claim(worker_id) if chosen else await self._pick(role, deadline)
            await self.adaptive.cores(deadline, worker_id)
            generate = messages.Generate(
                self.request_id,
                self.prompt_token_ids,
                self.sampling,
                done,
                prefill_chunk_tokens=self.adaptive.prefill_chunk_tokens(worker_id),
                cache_salt=self.cache_salt,
                stall_budget_s=self.adaptive.stall_budget_s(worker_id),
            )
            self.timing.on_dispatch()  # before the send: the worker may start at once
            self._send(worker_id, generate)
            self._charge_prefill(worker_id, len(done))
            self._transition("prefilling")
            reply = await self._next(watch=worker_id)
            if isinstance(reply, messages.Tokens):
                self._transition("decoding")
                return worker_id, reply
            self._on_refused(reply, deadline)
            worker_id = ""

    async def _disaggregated_first_token(self) -> tuple[str, messages.Tokens]:
        deadline = time.monotonic() + self.config.admission_timeout_s
        while True:  # admission: a decode worker with room for the prompt's KV
            self._new_attempt()
            decode_id = await self._pick("decode", deadline)
            ids, salt = self.prompt_token_ids, self.cache_salt
            self._send(decode_id, messages.Reserve(self.request_id, ids, self.sampling, salt))
            reply = await self._next(deadline)
            if isinstance(reply, messages.Reserved):
                break
            self._on_refused(reply, deadline)
        self._decode_id = decode_id
        self._transition("reserved")
        self.adaptive.num_sent_blocks = len(reply.block_ids) - reply.num_cached_blocks
        while True:  # prefill: D's reservation stays; a busy P may refuse, another may take it
            prefill_id = await self._pick("prefill", deadline)
            await self.adaptive.cores(deadline, prefill_id, decode_id)
            # Reserved's blocks as they are: P skips D's cached prefix and, over D's budget,
            # sends only the blocks D keeps.
            blocks = {k: v for k, v in vars(reply).items() if k not in ("worker_id", "request_id")}
            blocks["cache_salt"] = self.cache_salt
            prefill = messages.Prefill(
                self.request_id, self.prompt_token_ids, self.sampling, **blocks
            )
            self.timing.on_dispatch()  # before the send: the worker may start at once
            self._send(prefill_id, prefill)
            self._charge_prefill(prefill_id)
            self._transition("prefilling")
            first = await self._next(watch=prefill_id)
            if isinstance(first, messages.Tokens) and first.worker_id == prefill_id:
                self._release(prefill_id)  # P is done computing; its KV may still be in flight
                self.senders[prefill_id] = self.outstanding.pop(prefill_id)
                self._transition("prefilled")
                return prefill_id, first
            self._on_refused(first, deadline)

    def _servable_roles(self) -> set[str]:
        """The healthy roles less those whose every healthy worker missed a deadline for this
        request (a frozen engine whose heartbeat goes on): a re-drive goes around them, e.g.
        to the prefill worker when the one decode worker froze."""
        roles = self.plane.healthy_roles()
        return {r for r in roles if not self.plane.healthy_ids(r) <= self._stalled}

    async def _pick(self, role: str, deadline: float) -> str:
        """A worker of `role` chosen by the policy, waiting (with backoff) while every
        candidate is excluded because it just refused for lack of room."""
        backoff_s = 0.02
        while True:
            ids, salt = self.prompt_token_ids, self.cache_salt
            load = pick(self.plane, self.policy, ids, salt, role, self._excluded | self._stalled)
            if load is not None:
                return self._claim(load.worker_id)
            if role not in self.plane.healthy_roles():
                if self.plane.switching(role):  # re-drive with the roles there are now
                    raise Lost(f"every {role} worker is switching roles", reason="switching")
                raise unavailable(f"no healthy {role} worker")
            if self._stalled >= self.plane.healthy_ids(role):  # not empty: the role is healthy
                raise unavailable(f"every healthy {role} worker missed a deadline")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise unavailable(f"no {role} worker had room within the admission timeout")
            await asyncio.sleep(min(backoff_s, remaining))
            backoff_s = min(backoff_s * 2, 0.5)
            self._excluded.clear()

    def _claim(self, worker_id: str) -> str:
        self.outstanding[worker_id] = self.plane.workers[worker_id].epoch
        self.plane.workers[worker_id].active_requests += 1
        return worker_id

    def _on_refused(self, reply: Any, deadline: float) -> None:
        """Handle a non-success reply during admission: retry (return) or raise."""
        if not isinstance(reply, messages.Rejected):
            raise bad_gateway(f"unexpected {type(reply).__name__} during admission")
        self._release(reply.worker_id)
        self.outstanding.pop(reply.worker_id, None)
        if not reply.retryable:
            raise ApiError(400, f"request refused by the server: {reply.reason}")
        log.debug("request %s: %s has no room (%s)", self.request_id, reply.worker_id, reply.reason)
        self._excluded.add(reply.worker_id)
        if time.monotonic() >= deadline:
            raise unavailable(f"no worker had room within the admission timeout ({reply.reason})")
        self.fallbacks.rejections_retried.labels(reply.worker_id).inc()

    async def _next(
        self, deadline: float | None = None, watch: str = "", first_token: bool = True
    ) -> Any:
        """The next message from this attempt's workers (others' late ones dropped): 503 past
        `deadline`, Lost when an involved worker dies or fails or `watch` goes silent. Without
        a deadline (a token awaited) no timer is armed: the plane's `Tick`s wake the wait."""
        assert self._queue is not None
        field = "first_token_timeout_s" if first_token else "token_timeout_s"
        silent_until = time.monotonic() + getattr(self.config, field)
        while True:
            if not self._queue.empty():
                message = self._queue.get_nowait()
            elif deadline is None:
                message = await self._queue.get()
            else:
                timeout = min(_POLL_S, deadline - time.monotonic())
                if timeout <= 0:
                    raise unavailable("no worker answered within the admission timeout")
                try:  # not wait_for: it wraps the get in a task of its own
                    async with asyncio.timeout(timeout):
                        message = await self._queue.get()
                except TimeoutError:
                    message = None
            if message is None or isinstance(message, Tick):
                self._check_alive()
                silent = watch and time.monotonic() >= silent_until
                if silent and not self.plane.in_step_since(watch, silent_until):
                    self._stalled.add(watch)
                    running = self.plane.step_running_s(watch)
                    if running is not None and running >= self.config.step_timeout_s:
                        field, silent_s = "step_timeout_s", round(running, 1)  # inside one step
                    else:
                        silent_s = getattr(self.config, field)
                    error = f"worker {watch} sent nothing for {silent_s:g} s ({field})"
                    raise Lost(error, watch, "silent") from None
                continue
            involved = message.worker_id in self.outstanding or message.worker_id in self.senders
            if not involved:
                continue
            if isinstance(message, WorkerLost):
                raise Lost(f"worker {message.worker_id} lost: {message.reason}", message.worker_id)
            if isinstance(message, messages.Failed):
                error = f"worker {message.worker_id} failed: {message.error}"
                raise Lost(error, message.worker_id, "failed")
            return message

    def _on_tokens(self, worker_id: str, tokens: messages.Tokens, is_prefill: bool) -> Delta:
        if self.timing.first_token is None and tokens.token_ids:
            self.num_cached_tokens = tokens.num_cached_tokens  # the prefill's prefix hit
        decode = worker_id == self._decode_id and not is_prefill
        self.timing.on_tokens(len(tokens.token_ids), tokens.stamps, decode)
        self._release_prefill(worker_id)
        # A prefill worker's Tokens ends its part but not the request (a handoff is sent as
        # not finished); only a terminal reason from it (stop, length, abort) ends the request.
        worker_done = tokens.finished and (
            not is_prefill or tokens.finish_reason in _TERMINAL_REASONS
        )
        if worker_done:
            self._release(worker_id)
            self.outstanding.pop(worker_id, None)
            # D done: its KV landed. A prefill worker whose first token ends the request stays
            # in `senders`: its KV may still be on the way, and close() aborts that send too.
            if not is_prefill:
                self.senders.clear()
        room = self.params.max_tokens - self.num_output_tokens
        token_ids = tokens.token_ids[:room]
        hit_length = len(token_ids) >= room
        ended = worker_done or hit_length
        text = self.processor.process(self.key, token_ids, finished=ended)
        self.num_output_tokens = len(self.processor.states[self.key].token_ids)
        lp = tokens.logprobs and [[t, *e] for t, e in zip(token_ids, tokens.logprobs)]
        reason = "stop" if text.stopped else tokens.finish_reason or "stop"
        if not (text.stopped or worker_done):
            reason = "length" if hit_length else None
        return Delta(text.text, reason, lp, tokens.prompt_logprobs)

    def _check_alive(self) -> None:
        for worker_id, epoch in [*self.outstanding.items(), *self.senders.items()]:
            if not self.plane.is_healthy(worker_id, epoch):
                raise Lost(f"worker {worker_id} stopped responding", worker_id)

    def _new_attempt(self) -> None:
        if self.request_id:
            self.plane.close_request(self.request_id)
        self.num_attempts += 1
        self.request_id = f"{self.key}-{self.num_attempts}"
        self._queue = self.plane.open(self.request_id, tick=True)

    def _abort_attempt(self) -> None:
        """Abort the attempt on every worker that may still hold work for it."""
        involved = sorted({*self.outstanding, *self.senders})
        for worker_id in involved:
            self._send(worker_id, messages.Abort(self.request_id))
            self._release(worker_id)
        if involved:
            log.debug("request %s aborted on %s", self.request_id, involved)
        self.outstanding.clear()
        self.senders.clear()
        self._excluded.clear()
        if self.request_id:
            self.plane.close_request(self.request_id)

    def _send(self, worker_id: str, message: Any) -> None:
        if not self.plane.send(worker_id, message) and not isinstance(message, messages.Abort):
            raise Lost(f"cannot reach worker {worker_id}", worker_id, "unreachable")

    def _charge_prefill(self, worker_id: str, num_done: int = 0) -> None:
        num_tokens = len(self.prompt_token_ids) + num_done
        charge = self.plane.workers[worker_id].charge(num_tokens)
        self._prefill_charge[worker_id] = (charge, num_tokens)

    def _release_prefill(self, worker_id: str) -> None:
        charged = self._prefill_charge.pop(worker_id, None)
        worker = self.plane.workers.get(worker_id)
        if charged is None or worker is None:  # none, or removed (scaled down) meanwhile
            return
        worker.release(*charged)

    def _release(self, worker_id: str) -> None:
        """Undo the routing charges of `worker_id` (once: it leaves `outstanding` after)."""
        if worker_id in self.outstanding and worker_id in self.plane.workers:
            worker = self.plane.workers[worker_id]
            worker.active_requests = max(0, worker.active_requests - 1)
        self._release_prefill(worker_id)

    def _transition(self, state: str) -> None:
        log.debug("request %s: %s -> %s", self.request_id or self.key, self.state, state)
        self.state = state
