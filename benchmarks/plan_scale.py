"""`pdserve plan` at scale: a 1,024-GPU budget, a chat workload, wall time and layouts.

    .venv/bin/python benchmarks/plan_scale.py [--rate 130000] [--num-devices 1024]

Prints the planner's table, then the best disaggregated and best collocated units side by
side (simulated goodput per GPU) and how many GPUs each needs for the rate.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from pdserve.bench.app import build_plan
from pdserve.bench.cli import add_bench_arguments
from pdserve.sim.cli import SIMULATED_URL, add_sim_arguments, resolve_profile, sim_config
from pdserve.sim.plan import format_plan, search_layouts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_arguments(parser)
    add_sim_arguments(parser)
    parser.add_argument("--num-devices", type=int, default=1024)
    parser.add_argument("--probe-requests", type=int, default=300)
    parser.set_defaults(profile="analytic:H100-SXM:llama-3-8b", preset="chat", rate=130000.0,
                        slo_ttft_ms=500.0, slo_tpot_ms=50.0, max_num_seqs=256,
                        max_num_batched_tokens=8192, progress=False, max_probes=6)  # fmt: skip
    for action in parser._actions:
        if action.dest == "profile":
            action.required = False
    args = parser.parse_args()
    args.num_requests = args.probe_requests
    profile = resolve_profile(args.profile)
    plan = build_plan(args, url=SIMULATED_URL)
    start = time.perf_counter()
    result = search_layouts(plan, profile, sim_config(args), args.num_devices, args.rate,
                            args.goodput_target, max_probes=args.max_probes)  # fmt: skip
    wall_s = time.perf_counter() - start
    print(format_plan(result, 10, plan.slo, wall_s))
    print()
    for label, disaggregated in (("best disaggregated", True), ("best collocated", False)):
        best = max((c for c in result.candidates if c.unit.is_disaggregated == disaggregated),
                   key=lambda c: c.per_device, default=None)  # fmt: skip
        if best is None:
            print(f"{label:<20}none survived the search")
            continue
        needed = math.ceil(args.rate / best.goodput) * best.unit.num_devices if best.goodput else 0
        print(f"{label:<20}{best.unit.describe():<36}{best.per_device:>8.3g} req/s per GPU, "
              f"{needed} GPUs for {args.rate:g} req/s")  # fmt: skip
    print(f"{'wall time (s)':<20}{wall_s:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
