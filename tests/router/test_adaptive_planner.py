"""The router's planner against a control plane no worker answers: the decision's view of a
split and the core plan's are the same (docs/adaptive.md, "Sizing the split by the stall
budget")."""

from __future__ import annotations

from pdserve import messages
from pdserve.planner.config import AdaptiveConfig
from pdserve.router.adaptive_planner import Planner
from pdserve.router.config import RouterConfig, WorkerEndpoint
from pdserve.router.control_plane import ControlPlane
from pdserve.router.policies import RouteRequest, ShortestQueue
from tests.planner.conftest import ONE_B, two_cores

POOL = (0, 1)


def split_planner(tmp_path, num_running: int, num_waiting_remote: int) -> Planner:
    """A 1B model on two cores (the planner seeded with its steps, so a derived 1.8 s stall
    budget), the pool held split one core each; the decode worker runs `num_running`
    decodes and holds `num_waiting_remote` requests whose prompts wait on the prefill
    worker."""
    path = tmp_path / "profile.json"
    two_cores(ONE_B).save(path)
    endpoints = tuple(
        WorkerEndpoint(w, role, f"tcp://127.0.0.1:{port}", POOL)
        for w, role, port in (("p0", "prefill", 1), ("d1", "decode", 2))
    )
    plane = ControlPlane(RouterConfig(model="tiny", workers=endpoints))
    planner = Planner(AdaptiveConfig(enabled=True, profile=str(path)), plane)
    for worker_id, role, cpu in (("p0", "prefill", 1), ("d1", "decode", 0)):
        ready = messages.Ready(worker_id, role, "tiny", 64, 16, 1024, [cpu], 1, 1 << 20)
        w = plane.workers[worker_id]
        w.ready, w.last_seen = ready, plane.clock()
        planner.on_message(ready)
    queued = num_waiting_remote * 1024  # their prompts' tokens
    d1, p0 = plane.workers["d1"], plane.workers["p0"]
    d1.stats = messages.Stats("d1", "decode", num_waiting_remote, num_running, 40, 64, 0)
    d1.active_requests = num_running + num_waiting_remote
    p0.stats = messages.Stats("p0", "prefill", 0, num_waiting_remote, 64, 64, queued)
    p0.active_requests = num_waiting_remote
    return planner


def test_a_decision_sees_the_split_the_core_plan_keeps(tmp_path):
    # One decode runs (0.4 s a step on one core, within the budget's 1.35 s share), four
    # requests wait on the busy prefill worker. Counted as decodes, five would need both
    # cores (1.8 s on one): the decision took no split to hold and priced the prompt local
    # on the one core the plan kept, beside the decodes. Both count the one running.
    planner = split_planner(tmp_path, num_running=1, num_waiting_remote=4)
    demand = planner._demand(planner.plane.workers["d1"], len(POOL))
    assert demand.stall_threads == 1  # the plan keeps the split
    route = RouteRequest(num_prompt_tokens=1024, block_size=16)
    decision = planner.decide("r", route, ShortestQueue())
    assert decision.reason != "stall_split", decision
    # With five running, no split holds them: the plan and the decision say so together.
    five = split_planner(tmp_path, num_running=5, num_waiting_remote=0)
    assert five._demand(five.plane.workers["d1"], len(POOL)).stall_threads == len(POOL)
    kept = five.decide("r", route, ShortestQueue())
    assert (kept.kind, kept.reason) == ("local", "stall_split")
    assert kept.prefill_chunk_tokens is not None
