"""Adaptive disaggregation against collocated and static 1P1D on the same cores.

Per input length, collocated's capacity is measured first (every request sent at once), then
`pdserve bench compare` runs the three deployments at `--fractions` of it and prints their
goodput against collocated's (SLOs: 5x collocated's unloaded p50 TTFT and TPOT). Then the
interference cell: mixed-length prompts over long decodes with a stall budget (p99 ITL), where
`adaptive-slo` is the adaptive deployment told the targets (`adaptive.slo_ttft_ms`,
`adaptive.slo_itl_ms`). Its targets come from collocated's unloaded p50 of prompts at the
cell's 2,048-token cap; docs/adaptive.md. Every cell's rows go to `--output`.

    .venv/bin/python benchmarks/adaptive_grid.py --output grid.json
    .venv/bin/python benchmarks/adaptive_grid.py --lengths 128 --fractions 0.5
    .venv/bin/python benchmarks/adaptive_grid.py --lengths ""  # the interference cell only
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

DEPLOYMENTS = ("collocated=collocated", "1p1d=1p1d", "adaptive=adaptive")
INTERFERENCE_MAX_INPUT = 2048
INTERFERENCE_INPUT = f"lognormal:384:1.0:{INTERFERENCE_MAX_INPUT}"


def compare(flags: list[str], deployments: tuple[str, ...]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "compare.json"
        argv = [sys.executable, "-c", "import sys; from pdserve.cli import main; sys.exit(main())",
                "bench", "compare", "--no-progress", "--output", str(out), *flags]  # fmt: skip
        for d in deployments:
            argv += ["--deployment", d]
        print("$ pdserve", " ".join(argv[3:]), flush=True)
        subprocess.run(argv, check=True)
        return json.loads(out.read_text())["compare"]


def workload(input_len: str, output_len: str, seed: int) -> list[str]:
    return ["--input-len", input_len, "--output-len", output_len, "--seed", str(seed)]


def collocated_capacity(shape: list[str], num_requests: int) -> float:
    """Completed requests per second with every request sent at once (no SLO to calibrate)."""
    flags = [*shape, "--rate", "inf", "--num-requests", str(num_requests), "--slo-ttft-ms", "1e9"]
    probe = compare(flags, ("collocated=collocated",))
    return probe["collocated"]["summary"]["request_throughput"]


def unloaded_slos(shape: list[str]) -> tuple[float, float]:
    """(TTFT, TPOT) SLOs in ms: 5x collocated's unloaded p50 of `shape`'s prompts."""
    flags = [*shape, "--num-requests", "1", "--calibration-requests", "3"]
    calibration = compare(flags, ("collocated=collocated",))["collocated"]
    return calibration["slo_ttft_ms"], calibration["slo_tpot_ms"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="128,512,2048", help="mean input lengths")
    p.add_argument("--fractions", default="0.5,0.9", help="rates as fractions of capacity")
    p.add_argument("--output-len", default="lognormal:64:0.5")
    p.add_argument("--num-requests", type=int, default=30)
    p.add_argument("--capacity-requests", type=int, default=16)
    p.add_argument("--interference", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--itl-multiplier", type=float, default=2.0,
                   help="p99 ITL SLO: this x the longest prompts' TPOT")  # fmt: skip
    p.add_argument("--interference-fraction", type=float, default=0.7,
                   help="the interference cell's load")  # fmt: skip
    p.add_argument("--output", default="adaptive_grid.json")
    args = p.parse_args()
    results: dict = {"cells": [], "interference": None}
    for length in [int(x) for x in args.lengths.split(",") if x]:
        shape = workload(f"lognormal:{length}:0.3", args.output_len, seed=length)
        capacity = collocated_capacity(shape, args.capacity_requests)
        for fraction in [float(x) for x in args.fractions.split(",") if x]:
            rate = fraction * capacity
            rows = compare(
                [*shape, "--arrival", "poisson", "--rate", f"{rate:.4f}",
                 "--num-requests", str(args.num_requests), "--calibration-requests", "3"],
                DEPLOYMENTS,
            )  # fmt: skip
            results["cells"].append(
                {
                    "input_len": length,
                    "fraction": fraction,
                    "capacity_rps": capacity,
                    "rate_rps": rate,
                    "rows": rows,
                }  # fmt: skip
            )
            Path(args.output).write_text(json.dumps(results, indent=1))
    if args.interference:
        shape = workload(INTERFERENCE_INPUT, "lognormal:128:0.3", seed=7)
        capacity = collocated_capacity(shape, args.capacity_requests)
        rate = args.interference_fraction * capacity
        # SLOs: 5x collocated's unloaded p50 TTFT of prompts at the cell's cap, 5x the TPOT of
        # the cell's own prompts, p99 ITL at most --itl-multiplier x the longest prompts' TPOT.
        # adaptive-slo is told the same targets, as an operator would.
        tpot_ms = unloaded_slos(shape)[1]
        longest = workload(str(INTERFERENCE_MAX_INPUT), "lognormal:128:0.3", seed=7)
        ttft_ms, longest_tpot_ms = unloaded_slos(longest)
        itl_ms = args.itl_multiplier * longest_tpot_ms / 5
        with tempfile.TemporaryDirectory() as tmp:
            config = Path(tmp) / "adaptive-slo.yaml"
            config.write_text(f"adaptive: {{enabled: true, slo_ttft_ms: {ttft_ms:.1f}, "
                              f"slo_itl_ms: {itl_ms:.1f}}}\n")  # fmt: skip
            rows = compare(
                [*shape, "--arrival", "poisson", "--rate", f"{rate:.4f}", "--num-requests",
                 str(args.num_requests), "--slo-ttft-ms", f"{ttft_ms:.1f}", "--slo-tpot-ms",
                 f"{tpot_ms:.1f}", "--slo-itl-ms", f"{itl_ms:.1f}"],
                (*DEPLOYMENTS, f"adaptive-slo={config}"),
            )  # fmt: skip
        results["interference"] = {
            "fraction": args.interference_fraction,
            "capacity_rps": capacity,
            "rate_rps": rate,
            "slo_ms": {"ttft": ttft_ms, "tpot": tpot_ms, "p99_itl": itl_ms},
            "rows": rows,
        }
    Path(args.output).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
