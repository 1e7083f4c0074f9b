"""One simulated run of a `pdserve bench` plan (same sessions, arrivals, think time)."""

from __future__ import annotations

from pdserve.bench.app import BenchPlan
from pdserve.bench.runner import RunResult
from pdserve.costmodel.profile import HardwareProfile
from pdserve.planner.config import AdaptiveConfig
from pdserve.sim.adaptive import AdaptiveSimulation
from pdserve.sim.deployment import Deployment, SimConfig
from pdserve.sim.simulator import Simulation


def simulate_plan(
    plan: BenchPlan,
    profile: HardwareProfile,
    deployment: Deployment,
    config: SimConfig,
    planner: dict[str, object] | None = None,
) -> RunResult:
    """An adaptive deployment's planner aims at the plan's SLOs (TTFT, p99 ITL, max gap;
    without a max gap it derives its stall budget as the router's planner does); `planner`
    gets its decisions and the decode worker's stall guard (`AdaptiveSimulation.summary`)."""
    if plan.run.max_concurrency is not None:
        raise ValueError("the simulator does not model --max-concurrency")
    if deployment.adaptive:
        slo = AdaptiveConfig(
            enabled=True,
            slo_ttft_ms=plan.slo.ttft_ms,
            slo_itl_ms=plan.slo.itl_ms,
            slo_max_gap_ms=plan.slo.max_gap_ms,
        )
        simulation: Simulation = AdaptiveSimulation(profile, deployment, config, slo)
    else:
        simulation = Simulation(profile, deployment, config)
    result = simulation.run(
        plan.sessions, plan.run.arrival, plan.run.seed, plan.run.think_time_s, plan.run.duration_s
    )
    if planner is not None and isinstance(simulation, AdaptiveSimulation):
        planner.update(simulation.summary())
    return result
