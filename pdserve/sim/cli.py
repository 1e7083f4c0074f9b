"""`pdserve simulate` and `pdserve plan`: flags, the run, the report. Torch-free.

`simulate` takes every `pdserve bench` workload flag (same sessions for the same seed) and
prints the same summary; `plan` searches deployments for a device budget (sim/plan.py).
Bad input raises ValueError, which `pdserve` (cli.py) reports in one line, exit code 2.
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import replace

from pdserve.costmodel.profile import HardwareProfile, load_profile
from pdserve.schema import add_flags, flag_values, from_flat
from pdserve.sim.deployment import Deployment, SimConfig

# The bench plan wants a target URL; nothing is sent to it.
SIMULATED_URL = "http://simulated:0"


def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    sim = parser.add_argument_group("simulated deployment")
    sim.add_argument(
        "--profile",
        required=True,
        help="hardware profile JSON (pdserve profile), or analytic:DEVICE:MODEL "
        "(e.g. analytic:H100-SXM:llama-3-8b)",
    )
    add_flags(sim, SimConfig)


def resolve_profile(spec: str, model: str | None = None) -> HardwareProfile:
    """A profile file, or `analytic:DEVICE:MODEL` built from datasheet figures."""
    if spec.startswith("analytic:"):
        from pdserve.costmodel.analytic import analytic_profile, model_shape

        parts = spec.split(":")
        if len(parts) != 3:
            raise ValueError(f"--profile {spec!r}: expected analytic:DEVICE:MODEL")
        profile = analytic_profile(model_shape(parts[2]), parts[1])
    else:
        profile = load_profile(spec)
    profile.check_model(model)
    return profile


def sim_config(args: argparse.Namespace) -> SimConfig:
    return from_flat(SimConfig, flag_values(args, SimConfig))


def check_greedy(args: argparse.Namespace) -> None:
    """Profiles time greedy steps (pdserve/perf/measure.py): a sampled workload would be
    priced without its sampling, so it is refused rather than under-predicted."""
    if args.temperature:
        raise ValueError(
            f"--temperature {args.temperature:g}: profiles time greedy decoding, "
            "so simulate and plan take greedy workloads only (0)"
        )


def _workload_parser(
    subparsers: argparse._SubParsersAction, name: str, help: str
) -> argparse.ArgumentParser:
    """A subcommand taking a bench workload and a profile (`pdserve`'s subparsers already
    report errors in one line)."""
    from pdserve.bench.cli import add_bench_arguments

    parser = subparsers.add_parser(name, help=help)
    add_bench_arguments(parser)
    add_sim_arguments(parser)
    return parser


def add_simulate_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = _workload_parser(
        subparsers, "simulate", "replay a bench workload on a simulated deployment, from a profile"
    )
    parser.add_argument(
        "--deployment",
        default=None,
        help="collocated, Nc, NpMd or adaptive (default: what pdserve up runs on the profile's "
        "host: adaptive on 2 cores or more, else 1p1d)",
    )
    add_flags(parser, Deployment)
    parser.set_defaults(func=cmd_simulate)


def simulated_deployment(args: argparse.Namespace, profile: HardwareProfile) -> Deployment:
    """`--deployment` and the sizes given; on a CPU profile the rest as `pdserve up` would
    run them on the profiled host (its cores: `devices_per_node`), else one device each."""
    sizes = flag_values(args, Deployment)
    if profile.size_unit == "threads":
        return Deployment.on_host(args.deployment, profile.devices_per_node, **sizes)
    return Deployment.parse(args.deployment or "collocated", **sizes)


def cmd_simulate(args: argparse.Namespace) -> int:
    from pdserve.bench.app import build_plan, execute
    from pdserve.bench.cli import report
    from pdserve.sim.run import simulate_plan

    check_greedy(args)
    profile = resolve_profile(args.profile, args.model)
    deployment = simulated_deployment(args, profile)
    config = sim_config(args)
    plan = build_plan(args, url=SIMULATED_URL)
    # The workload's prompts live to the end: keep the cyclic collector from walking them
    # again and again (a 12,000-request trace replay: 59.8 s with it walking them, 58.4 without).
    gc.freeze()
    started = time.perf_counter()
    planner: dict[str, object] = {}  # an adaptive deployment's decisions and stall guard
    try:
        document, result = execute(
            plan,
            run=lambda run: simulate_plan(
                replace(plan, run=run), profile, deployment, config, planner
            ),
        )
    finally:
        gc.unfreeze()  # an in-process caller (a test) gets its collector back as it was
    wall_s = time.perf_counter() - started
    document["profile"] = args.profile
    print(f"{'deployment':<40}{deployment.describe()} ({profile.device}, {profile.model.name})")
    report(args, document, result.records, plan.slo)
    for name, value in planner.items():
        print(f"{'planner ' + name:<40}{value}")
    print(f"{'simulated in (s)':<40}{wall_s:.2f}")
    return 0


def add_plan_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = _workload_parser(
        subparsers, "plan", "search deployments for a workload, SLOs and a device budget"
    )
    parser.add_argument("--num-devices", type=int, required=True, help="the device budget")
    parser.add_argument("--top", type=int, default=5, help="layouts to print")
    parser.add_argument(
        "--probe-requests", type=int, default=300, help="requests per simulated probe"
    )
    parser.set_defaults(func=cmd_plan, max_probes=6)


def cmd_plan(args: argparse.Namespace) -> int:
    from pdserve.bench.app import build_plan
    from pdserve.sim.plan import format_plan, search_layouts

    check_greedy(args)
    profile = resolve_profile(args.profile, args.model)
    if args.slo_ttft_ms is None or args.slo_tpot_ms is None:
        raise ValueError("plan needs --slo-ttft-ms and --slo-tpot-ms")
    if args.rate == float("inf"):
        raise ValueError("plan needs --rate (the traffic to serve, requests/s)")
    args.num_requests = args.probe_requests
    plan = build_plan(args, url=SIMULATED_URL)
    gc.freeze()  # as in simulate
    started = time.perf_counter()
    try:
        result = search_layouts(
            plan,
            profile,
            sim_config(args),
            args.num_devices,
            args.rate,
            args.goodput_target,
            max_probes=args.max_probes,
        )
    finally:
        gc.unfreeze()
    wall_s = time.perf_counter() - started
    print(format_plan(result, args.top, plan.slo, wall_s))
    return 0
