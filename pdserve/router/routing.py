"""What a request asks of routing beside its driver's state machine (router/driver.py): the
route the policies see (`route_request`) and, in an adaptive deployment, the planner's part
(`AdaptiveRequest`: where it prefills, a parked worker's cores before work is sent to it,
the KV transfer time it measured; docs/adaptive.md)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pdserve.config import CacheConfig
from pdserve.kvcache.hashing import hash_blocks, root_hash, salted_root
from pdserve.planner.decision import LOCAL, Decision
from pdserve.router.policies import RouteRequest, RoutingPolicy, WorkerLoad
from pdserve.router.timing import RequestTiming

if TYPE_CHECKING:
    from pdserve.router.adaptive_planner import Planner
    from pdserve.router.control_plane import ControlPlane


class Lost(Exception):
    """The current attempt cannot finish (a worker died, failed, or missed a deadline).
    `worker_id` and `reason` label the re-drive's counter (pdserve/router/fallbacks.py)."""

    def __init__(self, message: str, worker_id: str = "", reason: str = "lost") -> None:
        super().__init__(message)
        self.worker_id, self.reason = worker_id, reason


def route_request(
    plane: ControlPlane,
    policy: RoutingPolicy,
    prompt_token_ids: list[int],
    role: str,
    cache_salt: str = "",
) -> RouteRequest:
    """What the policy sees of the request; block hashes only for policies that score
    cache overlap (they cost a blake2b per block), with the role's block size and model,
    in the request's cache scope (`cache_salt`), as its workers hash them."""
    ready = [w.ready for w in plane.workers.values() if w.ready and w.role == role]
    if not ready:  # nothing to route to: the block size the workers will have by default
        return RouteRequest(len(prompt_token_ids), CacheConfig().block_size)
    block_size = ready[0].block_size
    if not policy.needs_block_hashes:
        return RouteRequest(len(prompt_token_ids), block_size)
    parent = salted_root(root_hash(ready[0].model), cache_salt)
    hashes = hash_blocks(prompt_token_ids, block_size, parent)
    return RouteRequest(len(prompt_token_ids), block_size, hashes)


def pick(
    plane: ControlPlane,
    policy: RoutingPolicy,
    prompt_token_ids: list[int],
    cache_salt: str,
    role: str,
    excluded: set[str],
) -> WorkerLoad | None:
    """The policy's choice among the workers of `role` less `excluded`, or None."""
    route = route_request(plane, policy, prompt_token_ids, role, cache_salt)
    return policy.choose(role, plane.loads(route.block_hashes), route, excluded)


class AdaptiveRequest:
    """One request's dealings with the adaptive planner; every method is a no-op (local
    prefill never chosen, cores always there) when the deployment is not adaptive."""

    def __init__(self, plane: ControlPlane, key: str, cache_salt: str = "") -> None:
        self.plane, self.cache_salt = plane, cache_salt
        self.planner: Planner | None = plane.planner
        self.key = key
        self.decision: Decision | None = None
        self.num_sent_blocks = 0  # remote: the prompt blocks the decode worker expects

    def local_prefill(self, policy: RoutingPolicy, prompt_token_ids: list[int]) -> str:
        """The decode worker that prefills the request itself, or "" (remote)."""
        if self.planner is None:
            return ""
        route = route_request(self.plane, policy, prompt_token_ids, "decode", self.cache_salt)
        self.decision = self.planner.decide(self.key, route, policy)
        return self.decision.decode_id if self.decision.kind == LOCAL else ""

    def prefill_chunk_tokens(self, worker_id: str) -> int | None:
        """The SLO-sized chunk the planner chose for a local prefill on `worker_id`, or None
        (the worker's own chunk): it was priced for that worker's running decodes only."""
        d = self.decision
        return d.prefill_chunk_tokens if d is not None and d.decode_id == worker_id else None

    def stall_budget_s(self, worker_id: str) -> float | None:
        """The stall budget `worker_id` holds this request's prefill to beside its running
        decodes (engine/stall_guard.py), or None: not adaptive, or the budget is off."""
        return self.planner.stall_budget_s(worker_id) if self.planner else None

    async def cores(self, deadline: float, *worker_ids: str) -> None:
        """Return once every worker of `worker_ids` runs steps; one given none in time is
        lost for the request (it is re-driven)."""
        try:
            for worker_id in worker_ids if self.planner else ():
                if not await self.planner.cores_granted(worker_id, deadline - time.monotonic()):
                    raise Lost(
                        f"worker {worker_id} was given no cores within the admission timeout",
                        worker_id,
                        "no_cores",
                    )
        finally:  # the caller sends at once: its charge counts the prompt from here
            if self.planner:
                self.planner.dispatched(self.key)

    def on_landed(self, timing: RequestTiming) -> None:
        """A remote request's KV landed: its exposed transfer time is a planner sample."""
        if self.planner and self.decision is not None and self.num_sent_blocks > 0:
            self.planner.on_landed(self.decision, timing, self.num_sent_blocks)
