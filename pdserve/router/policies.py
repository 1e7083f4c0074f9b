"""Which worker gets a request: pure functions of worker loads (torch-free, no I/O).

The driver asks one question per phase: "which `role` worker for this request?", passing a
snapshot of every worker's load. Policies never see sockets or clocks, so the simulator
(pdserve/sim) reuses them as they are and tests can assert exact choices.

`prefix_cache` scores workers by how many of the request's leading block hashes each one
holds; `RouteRequest.block_hashes` carries them (computed by the driver only when the policy
sets `needs_block_hashes`, with `pdserve.kvcache.hashing.hash_blocks`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class WorkerLoad:
    """One worker as the router sees it now: last Stats plus the router's own unacknowledged
    work (sent since that Stats was taken, so not in it yet)."""

    worker_id: str
    role: str
    healthy: bool
    num_waiting: int = 0
    num_running: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_queued_prefill_tokens: int = 0  # reported + sent by the router, not yet prefilled
    num_active_requests: int = 0  # requests the router has on this worker right now
    num_cached_blocks: int = 0  # leading blocks of the request's prompt this worker caches


@dataclass(frozen=True)
class RouteRequest:
    num_prompt_tokens: int
    block_size: int  # the workers' (their Ready), which `num_cached_blocks` counts in
    block_hashes: Sequence[int] = field(default_factory=tuple)


class RoutingPolicy(ABC):
    """Contract: `choose` returns a healthy worker of `role` not in `exclude`, or None when
    there is none: the one of least `cost`; ties rotate in id order (so equal workers share
    load between Stats reports)."""

    name: str = ""
    needs_block_hashes: bool = False
    always_rotates: bool = False  # True: a worker without a tie takes a turn too

    def __init__(self, load_balancer: RoutingPolicy | None = None) -> None:
        self._last: dict[str, str] = {}  # role -> id of the worker the last turn went to
        # Picks decode workers when given; this policy then picks prefill and collocated
        # ones (where a cached prefix saves work).
        self.load_balancer = load_balancer

    def choose(
        self,
        role: str,
        workers: Sequence[WorkerLoad],
        request: RouteRequest,
        exclude: Collection[str] = (),
    ) -> WorkerLoad | None:
        if role == "decode" and self.load_balancer is not None:
            return self.load_balancer.choose(role, workers, request, exclude)
        candidates = [
            w for w in workers if w.role == role and w.healthy and w.worker_id not in exclude
        ]
        if not candidates:
            return None
        costs = [self.cost(role, w, request) for w in candidates]
        best = min(costs)
        tied = [w for w, c in zip(candidates, costs) if c == best]
        tied.sort(key=lambda w: w.worker_id)
        if len(tied) == 1 and not self.always_rotates:
            return tied[0]
        last = self._last.get(role)
        # The first id after the last one chosen; ids (not indexes) so joins/leaves keep order.
        chosen = next((w for w in tied if last is None or w.worker_id > last), tied[0])
        self._last[role] = chosen.worker_id
        return chosen

    @abstractmethod
    def cost(self, role: str, w: WorkerLoad, request: RouteRequest) -> tuple[int, ...]: ...


class RoundRobin(RoutingPolicy):
    """Each role cycles through its workers in id order, skipping the unhealthy."""

    name = "round_robin"
    always_rotates = True

    def cost(self, role: str, w: WorkerLoad, request: RouteRequest) -> tuple[int, ...]:
        return ()


class ShortestQueue(RoutingPolicy):
    """Least loaded worker. Prefill cost is the prefill tokens queued on it (the time until
    this prompt's first token); decode cost is its active requests, then fewer free blocks
    (a decode worker's batch slots and KV are what run out). Collocated workers pay both, in
    that order."""

    name = "shortest_queue"

    def cost(self, role: str, w: WorkerLoad, request: RouteRequest) -> tuple[int, ...]:
        active = max(w.num_running + w.num_waiting, w.num_active_requests)
        if role == "prefill":
            return (w.num_queued_prefill_tokens, w.num_waiting)
        if role == "decode":
            return (active, -w.num_free_blocks)
        return (w.num_queued_prefill_tokens, active, -w.num_free_blocks)


class PrefixCache(ShortestQueue):
    """KV-aware: the prefill (or collocated) worker that finishes this prompt first, counting
    what it need not compute. Cost = prompt tokens it lacks in its prefix cache + prefill
    tokens already queued on it, then as `shortest_queue`; so a cache hit wins until the
    holder's queue is longer than the tokens the hit saves (overlap never beats a large load
    gap). Decode workers hold no reusable prompt KV: they are chosen by queue length."""

    name = "prefix_cache"
    needs_block_hashes = True

    def cost(self, role: str, w: WorkerLoad, request: RouteRequest) -> tuple[int, ...]:
        by_queue = super().cost(role, w, request)
        if role == "decode":
            return by_queue
        cached = min(w.num_cached_blocks * request.block_size, request.num_prompt_tokens)
        return (request.num_prompt_tokens - cached + by_queue[0], *by_queue[1:], by_queue[0])


POLICIES = {p.name: p for p in (RoundRobin, ShortestQueue, PrefixCache)}


def make_policy(name: str, load_balancer: str | None = None) -> RoutingPolicy:
    for n in (name, load_balancer or name):
        if n not in POLICIES:
            raise ValueError(f"unknown routing policy {n!r}; choose from {sorted(POLICIES)}")
    if load_balancer is None or load_balancer == name:
        return POLICIES[name]()
    return POLICIES[name](POLICIES[load_balancer]())
