"""Routing policies are pure functions of worker loads: exact choices, unhealthy skipped."""

from __future__ import annotations

import pytest

from pdserve.router.policies import RoundRobin, RouteRequest, ShortestQueue, WorkerLoad, make_policy
from pdserve.router.policies import WorkerLoad as W

REQ = RouteRequest(num_prompt_tokens=10, block_size=16)


def ids(policy, role: str, workers: list[W], n: int) -> list[str | None]:
    return [getattr(policy.choose(role, workers, REQ), "worker_id", None) for _ in range(n)]


def test_round_robin_cycles_in_id_order_per_role() -> None:
    workers = [W("p1", "prefill", True), W("p0", "prefill", True), W("d0", "decode", True)]
    policy = RoundRobin()
    assert ids(policy, "prefill", workers, 3) == ["p0", "p1", "p0"]
    assert ids(policy, "decode", workers, 2) == ["d0", "d0"]


def test_round_robin_skips_unhealthy_and_excluded() -> None:
    workers = [W("p0", "prefill", True), W("p1", "prefill", False), W("p2", "prefill", True)]
    policy = RoundRobin()
    assert ids(policy, "prefill", workers, 3) == ["p0", "p2", "p0"]
    assert policy.choose("prefill", workers, REQ, exclude={"p0", "p2"}) is None
    assert policy.choose("collocated", workers, REQ) is None


def test_shortest_queue_prefill_counts_queued_prefill_tokens() -> None:
    workers = [
        W("p0", "prefill", True, num_queued_prefill_tokens=900),
        W("p1", "prefill", True, num_queued_prefill_tokens=100, num_running=50),
        W("p2", "prefill", False, num_queued_prefill_tokens=0),  # idle but dead
    ]
    assert ids(ShortestQueue(), "prefill", workers, 2) == ["p1", "p1"]


def test_shortest_queue_decode_prefers_fewer_running_then_more_free_blocks() -> None:
    workers = [
        W("d0", "decode", True, num_running=4, num_free_blocks=900),
        W("d1", "decode", True, num_running=2, num_free_blocks=10),
        W("d2", "decode", True, num_running=2, num_free_blocks=50),
    ]
    assert ids(ShortestQueue(), "decode", workers, 1) == ["d2"]
    # The router's own in-flight count wins over a stale Stats report.
    workers[2] = W("d2", "decode", True, num_running=2, num_free_blocks=50, num_active_requests=5)
    assert ids(ShortestQueue(), "decode", workers, 1) == ["d1"]


def test_shortest_queue_rotates_among_equals() -> None:
    workers = [W(f"c{i}", "collocated", True) for i in range(3)]
    assert ids(ShortestQueue(), "collocated", workers, 4) == ["c0", "c1", "c2", "c0"]


def test_make_policy_names() -> None:
    assert isinstance(make_policy("round_robin"), RoundRobin)
    assert not make_policy("shortest_queue").needs_block_hashes
    assert make_policy("prefix_cache").needs_block_hashes
    with pytest.raises(ValueError, match="unknown routing policy 'random'"):
        make_policy("random")


def _prefill(worker_id: str, cached_blocks: int, queued: int) -> WorkerLoad:
    return WorkerLoad(
        worker_id,
        "prefill",
        True,
        num_queued_prefill_tokens=queued,
        num_cached_blocks=cached_blocks,
    )


def test_prefix_cache_sends_a_repeated_prefix_to_its_holder() -> None:
    policy = make_policy("prefix_cache")
    request = RouteRequest(num_prompt_tokens=1000, block_hashes=tuple(range(62)), block_size=16)
    holder, other = _prefill("p0", 60, queued=300), _prefill("p1", 0, queued=0)
    # p0 lacks 40 tokens + 300 queued = 340 < p1's 1000: the cache wins despite the queue.
    assert policy.choose("prefill", [holder, other], request).worker_id == "p0"


def test_prefix_cache_loses_to_a_large_load_gap() -> None:
    policy = make_policy("prefix_cache")
    request = RouteRequest(num_prompt_tokens=1000, block_hashes=tuple(range(62)), block_size=16)
    busy_holder, idle = _prefill("p0", 60, queued=5000), _prefill("p1", 0, queued=0)
    assert policy.choose("prefill", [busy_holder, idle], request).worker_id == "p1"


def test_by_role_splits_routing_and_load_balancing() -> None:
    policy = make_policy("prefix_cache", "round_robin")
    request = RouteRequest(num_prompt_tokens=10, block_size=16)
    decodes = [WorkerLoad("d0", "decode", True), WorkerLoad("d1", "decode", True)]
    assert [policy.choose("decode", decodes, request).worker_id for _ in range(3)] == [
        "d0",
        "d1",
        "d0",
    ]
    assert policy.needs_block_hashes
