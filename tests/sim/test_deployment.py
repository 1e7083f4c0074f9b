"""The simulated deployment (pdserve/sim/deployment.py): by default, what `pdserve up` runs on
the same host."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from pdserve.cli import build_parser
from pdserve.cluster.launcher import worker_specs
from pdserve.cluster.up import pipeline_from_args
from pdserve.costmodel.analytic import analytic_profile, model_shape
from pdserve.sim.cli import simulated_deployment
from pdserve.sim.deployment import Deployment, SimConfig

# (up's flags, simulate's --deployment): the same layout asked of each.
LAYOUTS = [
    ((), None),
    (("--collocated", "1"), "collocated"),
    (("--collocated", "2", "--pin-cpus"), "2c"),
    (("--prefill", "1", "--decode", "1", "--pin-cpus"), "1p1d"),
    (("--adaptive",), "adaptive"),
]


def up_workers(argv: tuple[str, ...], cores: int) -> tuple[bool, list[tuple[str, int]]]:
    """Whether `pdserve up` with `argv` plans its workers, and each one's role and threads on
    a host of `cores` cores (a worker given no threads and no cores runs torch's default,
    one per core)."""
    pipeline = pipeline_from_args(build_parser().parse_args(["up", *argv]))
    specs = worker_specs(pipeline, "tcp://127.0.0.1:1")
    sizes = [(s.role, s.engine.device.threads or len(s.cpus) or cores) for s in specs]
    return pipeline.adaptive.enabled, sorted(sizes)


@pytest.mark.parametrize("cores", [1, 2, 4])
@pytest.mark.parametrize("argv, spec", LAYOUTS)
def test_the_default_deployment_is_what_up_runs_on_the_same_host(monkeypatch, cores, argv, spec):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))
    if spec == "adaptive" and cores < 2:
        with pytest.raises(ValueError, match="needs >= 2"):
            Deployment.on_host(spec, cores)
        return
    deployment = Deployment.on_host(spec, cores)
    simulated = sorted((role, size) for _, role, size in deployment.workers())
    assert (deployment.adaptive, simulated) == up_workers(argv, cores)


def test_simulate_takes_the_profiled_hosts_cores_and_the_sizes_given():
    cpu = dataclasses.replace(
        analytic_profile(model_shape("llama-3-8b"), "H100-SXM", sizes=(1,)),
        size_unit="threads",
        devices_per_node=4,
    )
    args = argparse.Namespace(deployment=None)
    assert simulated_deployment(args, cpu) == Deployment.parse("adaptive", collocated_size=4)
    args = argparse.Namespace(deployment="collocated")
    assert simulated_deployment(args, cpu).collocated_size == 4
    args = argparse.Namespace(deployment="collocated", collocated_size=1)
    assert simulated_deployment(args, cpu).collocated_size == 1
    gpu = dataclasses.replace(cpu, size_unit="tensor_parallel")
    assert simulated_deployment(argparse.Namespace(deployment=None), gpu).collocated_size == 1


def test_simulate_routes_as_up_does(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    pipeline = pipeline_from_args(build_parser().parse_args(["up"]))
    config = SimConfig()
    assert (config.routing, config.load_balancer) == (pipeline.routing, pipeline.load_balancer)
