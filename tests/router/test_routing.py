"""What the routing policies are told of a request (pdserve/router/routing.py)."""

from __future__ import annotations

from types import SimpleNamespace

from pdserve.config import CacheConfig
from pdserve.router.policies import make_policy
from pdserve.router.routing import route_request


def plane(block_size: int | None) -> SimpleNamespace:
    ready = SimpleNamespace(model="m", block_size=block_size) if block_size else None
    return SimpleNamespace(workers={"d0": SimpleNamespace(role="decode", ready=ready)})


def test_the_route_counts_in_the_workers_block_size_with_or_without_hashes():
    prompt = list(range(100))
    by_queue = route_request(plane(32), make_policy("shortest_queue"), prompt, "decode")
    assert (by_queue.num_prompt_tokens, by_queue.block_size, by_queue.block_hashes) == (100, 32, ())
    by_cache = route_request(plane(32), make_policy("prefix_cache"), prompt, "decode")
    assert by_cache.block_size == 32 and len(by_cache.block_hashes) == 3  # full blocks only
    # No worker of the role has said its block size yet: the configured default.
    unknown = route_request(plane(None), make_policy("prefix_cache"), prompt, "decode")
    assert unknown.block_size == CacheConfig().block_size and unknown.block_hashes == ()
