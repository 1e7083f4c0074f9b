"""Continuous batching with chunked prefill and preemption by recompute. Torch-free.

Each step hands out a token budget: running requests first (a decode needs 1 token, an
unfinished prefill its next chunk), then waiting requests in arrival order. When blocks run
out, the most recently admitted running request is preempted: its blocks are freed and it
goes back to the front of the queue, to be recomputed from its prompt and the tokens it has
already produced. Nothing crashes and no finished token is lost.

While a request with `prefill_chunk_tokens` (the adaptive planner's SLO-sized chunk)
prefills, it bounds the prefill tokens of every step it takes part in, its own and others'
together: the decodes of that step were promised a step no longer than the planner priced. A
waiting request that would exceed a cap waits (first come, first served), a running one sits
the step out.

A request with `stall_budget_s` (the adaptive planner's stall budget, sent with a local
prefill on the decode worker) caps the same way, in every step it prefills in that also
carries decodes: at what this worker's measured steps say fits the budget
(`StallGuard.cap()`, engine/stall_guard.py), so a mispriced prefill cannot freeze the
streams beside it. With no decode in the step nothing is stalled and it takes full chunks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.config import SchedulerConfig
from pdserve.engine.stall_guard import StallGuard
from pdserve.kvcache.manager import KVCacheManager
from pdserve.request import FinishReason, Request, RequestStatus


@dataclass
class SchedulerOutput:
    """What to run this step: `(request, num_new_tokens)` pairs, one-token decodes first."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    def samples(self, request: Request, num_new_tokens: int) -> bool:
        """Whether this step reaches the end of the request's known tokens, so the logits of
        its last position give a new token (a middle prefill chunk samples nothing)."""
        return request.num_computed_tokens + num_new_tokens == request.num_tokens


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        preallocate_prompt: bool = False,
    ) -> None:
        """`preallocate_prompt` (the prefill role) reserves a prompt's blocks in full on
        admission, so a running prefill never needs more and is never preempted: its blocks
        may be being read by a KV transfer."""
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.preallocate_prompt = preallocate_prompt
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stall_guard = StallGuard()  # the engine feeds it each step's time
        self._num_decodes = 0  # running decodes, as the step being scheduled counted them

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_queued_tokens(self) -> int:
        """Tokens not yet computed over every request here, as a worker's Stats report them
        (a decoding request counts the one token it has yet to run)."""
        return sum(r.num_tokens - r.num_computed_tokens for r in [*self.waiting, *self.running])

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        chunk = self.config.long_prefill_token_threshold
        stall_cap, prefill_left = self._step_caps()

        scheduled_running: list[tuple[Request, int]] = []
        prefill_used = 0  # prefill tokens scheduled this step
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = request.num_tokens - request.num_computed_tokens
            if num_new > 1:  # a prefill's next chunk (a decode's 1 fits any budget left)
                num_new = min(num_new, chunk, budget)
            if num_new > 1:
                num_new = min(num_new, prefill_left)
                if num_new <= 0:
                    i += 1
                    continue
                prefill_left -= num_new
            while not self.kv.allocate(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled_running.append((request, num_new))
                budget -= num_new
                if num_new > 1:
                    prefill_used += num_new
                i += 1
                continue
            break  # the request itself was preempted; everything after it already was

        scheduled_new: list[tuple[Request, int]] = []
        while (
            self.waiting
            and not out.preempted
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            hits = self.kv.find_cached_prefix(request)
            num_hit_tokens = len(hits) * self.kv.block_size
            num_new = min(request.num_tokens - num_hit_tokens, chunk, budget)
            cap = stall_cap(request)
            # Taken already this step: the running prefills' tokens, whatever their caps.
            cap_left = prefill_left if cap is None else min(prefill_left, cap - prefill_used)
            if num_new > 1:
                num_new = min(num_new, cap_left)
                if num_new <= 0:
                    break
            num_reserved = (
                request.num_tokens - num_hit_tokens if self.preallocate_prompt else num_new
            )
            if not self.kv.allocate(request, num_reserved, hits):
                break  # first come, first served: do not let later requests jump ahead
            self.waiting.popleft()
            self.kv.record_admission(request, len(hits))
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled_new.append((request, num_new))
            budget -= num_new
            if num_new > 1:
                prefill_used += num_new
                prefill_left = cap_left - num_new

        # Decodes first: the model runner batches one-token rows together.
        everything = scheduled_running + scheduled_new
        if prefill_used:
            everything = [x for x in everything if x[1] == 1] + [x for x in everything if x[1] > 1]
        out.scheduled = everything
        return out

    def _step_caps(self) -> tuple[Callable[[Request], int | None], int]:
        """A prefill's cap in this step (its stall budget's only beside running decodes), and
        the prefill tokens the step may take: the least cap of a capped prefill running."""
        capped, num_decodes = [], 0
        for r in self.running:
            if r.num_tokens - r.num_computed_tokens <= 1:
                num_decodes += 1
            elif r.prefill_chunk_tokens is not None or r.stall_budget_s is not None:
                capped.append(r)
        self._num_decodes = num_decodes
        stall_cap = self._stall_cap if num_decodes else _no_stall_cap
        caps = [c for r in capped if (c := stall_cap(r)) is not None]
        # (Not min(..., default=...): the keyword alone cost 1 us a step.)
        return stall_cap, min(caps) if caps else self.config.max_num_batched_tokens

    def _stall_cap(self, request: Request) -> int | None:
        """`request`'s cap in a step beside the running decodes (`_step_caps` counted them):
        its chunk and its stall budget's."""
        cap = request.prefill_chunk_tokens
        if request.stall_budget_s is None:
            return cap
        tokens = self.stall_guard.cap(request.stall_budget_s, self._num_decodes)
        return tokens if cap is None else min(cap, tokens)

    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, int]
    ) -> list[tuple[Request, int | None]]:
        """Advance every scheduled request; returns (request, new token or None), with
        finished requests already released."""
        results = []
        for request, num_new in out.scheduled:
            if request.is_finished:  # aborted between schedule() and now
                continue
            request.num_computed_tokens += num_new
            token = sampled.get(request.request_id)
            reason = None
            if token is not None:
                request.output_token_ids.append(token)
                reason = self._check_stop(request, token)
                if reason is not None:
                    # A prefill keeps its blocks: the engine frees them once sent.
                    self.finish_request(request.request_id, reason, not request.prefill_only)
            if reason is None or not request.is_finished:
                self.kv.cache_computed_blocks(request)
            results.append((request, token))
        return results

    def add_running(self, request: Request) -> None:
        """Admit a request whose KV is already in place (decode role, after the transfer)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def finish_request(
        self, request_id: str, reason: FinishReason, free_blocks: bool = True
    ) -> Request | None:
        """End a request however it ends (stop, length, abort, handoff). Its blocks are
        freed unless the caller keeps them (a prefill whose KV is still being sent)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        if request.num_computed_tokens:
            self.kv.cache_computed_blocks(request)
        if free_blocks:
            self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        return request

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_dropped_tokens = 0
        request.num_cached_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _check_stop(self, request: Request, token: int) -> FinishReason | None:
        params = request.sampling_params
        eos = not params.ignore_eos and token in request.eos_token_ids
        if eos or token in params.stop_token_ids or request.grammar_done:
            return FinishReason.STOP
        num_output = len(request.output_token_ids)
        if num_output >= params.max_tokens:
            return FinishReason.LENGTH
        if len(request.prompt_token_ids) + num_output >= self.max_model_len:  # num_tokens
            return FinishReason.LENGTH
        if request.prefill_only:
            return FinishReason.HANDOFF
        return None


def _no_stall_cap(request: Request) -> int | None:
    """`request`'s cap in a step without decodes: no stream to stall, its chunk alone."""
    return request.prefill_chunk_tokens
