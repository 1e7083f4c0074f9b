"""Adaptive disaggregation against collocated and static 1P1D on the same cores.

Cells are input length x output length x load. Per (input, output) length a probe measures
collocated first: its unloaded p50 TTFT and TPOT (sequential requests) and its capacity (every
request sent at once). Each cell then runs `pdserve bench compare` over the three deployments
at `--fractions` of that capacity, all under the probe's SLOs: a request is good when its TTFT
is at most 5x the unloaded p50 and no gap between its streamed tokens exceeds
`--slo-max-gap-multiplier` x the unloaded TPOT (the stall budget; `--slo-tpot-multiplier`
adds a TPOT target). Every cell's estimated wall time is printed before any cell runs
(`--estimate-only` stops there). `--rounds N` runs the cell list N times, round after round,
so repeated cells interleave and drift spreads over all of them. `--simulate PROFILE` replays
each cell's workload on `pdserve simulate` too and reports its error against the real run.

Then the interference cell: mixed-length prompts over long decodes with a p99 ITL budget,
where `adaptive-slo` is the adaptive deployment told the targets (`adaptive.slo_ttft_ms`,
`adaptive.slo_itl_ms`), from collocated's unloaded p50 of prompts at the cell's 2,048-token
cap; docs/adaptive.md. Every row goes to `--output` (JSON) and a markdown table beside it.

    .venv/bin/python benchmarks/adaptive_grid.py --output grid.json
    .venv/bin/python benchmarks/adaptive_grid.py --lengths 128 --fractions 0.5
    .venv/bin/python benchmarks/adaptive_grid.py --lengths ""  # the interference cell only
    .venv/bin/python benchmarks/adaptive_grid.py --model /tmp/llama-1b-q4_1.gguf \\
        --lengths 512,2048 --input-sigma 0 --output-lens 64,256 \\
        --num-requests 512:12,2048:8 --no-interference --estimate-only
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.bench.workloads import LengthDist

DEPLOYMENTS = ("collocated=collocated", "1p1d=1p1d", "adaptive=adaptive")
INTERFERENCE_MAX_INPUT = 2048
INTERFERENCE_INPUT = f"lognormal:384:1.0:{INTERFERENCE_MAX_INPUT}"
INTERFERENCE_CAPACITY_REQUESTS = 16
SLO_MULTIPLIER = 5.0  # TTFT target: this x collocated's unloaded p50 (compare's default)
CALIBRATION_REQUESTS = 3
PDSERVE = [sys.executable, "-c", "import sys; from pdserve.cli import main; sys.exit(main())"]


def pdserve(argv: list[str]) -> None:
    print("$ pdserve", " ".join(argv), flush=True)
    subprocess.run([*PDSERVE, *argv], check=True)


def compare(flags: list[str], deployments: tuple[str, ...]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "compare.json"
        argv = ["bench", "compare", "--no-progress", "--output", str(out), *flags]
        for d in deployments:
            argv += ["--deployment", d]
        pdserve(argv)
        return json.loads(out.read_text())["compare"]


def simulate(flags: list[str], profile: str, deployment: str) -> dict:
    """The summary of `pdserve simulate` of the same workload on `deployment`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "simulate.json"
        argv = [
            "simulate",
            "--no-progress",
            "--output",
            str(out),
            "--profile",
            profile,
            "--deployment",
            deployment,
            *flags,
        ]
        pdserve(argv)
        return json.loads(out.read_text())["summary"]


def workload(input_len: str, output_len: str, seed: int) -> list[str]:
    return ["--input-len", input_len, "--output-len", output_len, "--seed", str(seed)]


def per_length(text: str, lengths: list[int]) -> dict[int, int]:
    """'12' -> 12 for every length; '512:12,2048:10' -> per length (each must be given)."""
    if ":" not in text:
        return dict.fromkeys(lengths, int(text))
    counts = {int(k): int(v) for k, v in (item.split(":") for item in text.split(","))}
    if missing := [n for n in lengths if n not in counts]:
        raise SystemExit(f"request counts {text!r}: no count for lengths {missing}")
    return counts


def mean_len(spec: str) -> float:
    dist = LengthDist.parse(spec)
    return (dist.a + dist.b) / 2 if dist.kind == "uniform" else dist.a


@dataclass(frozen=True)
class Probe:
    """Collocated at one (input, output) shape: unloaded p50s and capacity."""

    ttft_ms: float
    tpot_ms: float
    capacity_rps: float
    launch_s: float  # the probe's wall time less its requests': a deployment's start

    def e2e_s(self, output_len: float) -> float:
        return (self.ttft_ms + self.tpot_ms * max(0.0, output_len - 1)) / 1e3

    def estimate_s(self, num_requests: int, rate_rps: float, output_len: float) -> float:
        """One deployment's run: its start, the arrivals' span, the last request's latency."""
        return self.launch_s + num_requests / rate_rps + self.e2e_s(output_len)


def probe(shape: list[str], num_requests: int, output_len: float) -> Probe:
    """Capacity (every request at once) after compare's own unloaded calibration, one run."""
    flags = [
        *shape,
        "--rate",
        "inf",
        "--num-requests",
        str(num_requests),
        "--calibration-requests",
        str(CALIBRATION_REQUESTS),
        "--slo-multiplier",
        str(SLO_MULTIPLIER),
    ]
    started = time.monotonic()
    row = compare(flags, ("collocated=collocated",))["collocated"]
    wall_s = time.monotonic() - started
    ttft_ms, tpot_ms = row["slo_ttft_ms"] / SLO_MULTIPLIER, row["slo_tpot_ms"] / SLO_MULTIPLIER
    summary = row["summary"]
    unloaded = Probe(ttft_ms, tpot_ms, summary["request_throughput"], 0.0)
    requests_s = CALIBRATION_REQUESTS * unloaded.e2e_s(output_len) + summary["duration_s"]
    return Probe(ttft_ms, tpot_ms, summary["request_throughput"], max(0.0, wall_s - requests_s))


@dataclass(frozen=True)
class Cell:
    input_len: int
    output_len: str
    fraction: float
    num_requests: int
    round: int = 0


def slo_flags(args: argparse.Namespace, unloaded: Probe) -> list[str]:
    flags = ["--slo-ttft-ms", f"{SLO_MULTIPLIER * unloaded.ttft_ms:.1f}"]
    if args.slo_max_gap_multiplier:
        flags += ["--slo-max-gap-ms", f"{args.slo_max_gap_multiplier * unloaded.tpot_ms:.1f}"]
    if args.slo_tpot_multiplier:
        flags += ["--slo-tpot-ms", f"{args.slo_tpot_multiplier * unloaded.tpot_ms:.1f}"]
    return flags


def cell_flags(args: argparse.Namespace, cell: Cell, unloaded: Probe) -> list[str]:
    """The workload, arrivals and SLOs a cell's compare and its simulations share."""
    rate = cell.fraction * unloaded.capacity_rps
    return [
        *shape_flags(args, cell.input_len, cell.output_len),
        "--arrival",
        "poisson",
        "--rate",
        f"{rate:.4f}",
        "--num-requests",
        str(cell.num_requests),
        *slo_flags(args, unloaded),
    ]


def shape_flags(args: argparse.Namespace, input_len: int, output_len: str) -> list[str]:
    spread = f"lognormal:{input_len}:{args.input_sigma}" if args.input_sigma else str(input_len)
    model = ["--model", args.model] if args.model else []
    return [*model, *workload(spread, output_len, seed=input_len)]


def row_of(summary: dict) -> dict:
    """What a cell reports per deployment, from a bench or simulate summary."""
    good = round(summary["slo_attainment"] * summary["num_requests"])
    return {
        "good": good,
        "num_requests": summary["num_requests"],
        "goodput": summary["goodput"],
        "p50_ttft_ms": summary["ttft_ms"]["p50"],
        "p90_ttft_ms": summary["ttft_ms"]["p90"],
        "max_gap_ms": summary["max_gap_ms"],
    }


def run_cell(args: argparse.Namespace, cell: Cell, unloaded: Probe) -> dict:
    flags = cell_flags(args, cell, unloaded)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        rows = compare(flags, deployments(args, unloaded, Path(tmp)))
    wall_s = time.monotonic() - started
    result = {
        **asdict(cell),
        "capacity_rps": unloaded.capacity_rps,
        "rate_rps": cell.fraction * unloaded.capacity_rps,
        "unloaded": asdict(unloaded),
        "estimate_s": cell_estimate_s(cell, unloaded),
        "wall_s": wall_s,
        "flags": flags,
        "real": {name: row_of(row["summary"]) for name, row in rows.items()},
        "rows": rows,
    }
    if args.simulate:
        result["simulated"] = simulate_cell(flags, args.simulate)
    return result


def simulate_cell(flags: list[str], profile: str) -> dict:
    """Each deployment's row from `pdserve simulate` of a cell's workload (its `flags`): its
    adaptive deployment aims its planner at the workload's SLOs, as the real one is told."""
    return {
        name: row_of(simulate(flags, profile, spec))
        for name, spec in (d.split("=") for d in DEPLOYMENTS)
    }


def deployments(args: argparse.Namespace, unloaded: Probe, tmp: Path) -> tuple[str, ...]:
    """Collocated, 1p1d and the adaptive deployment told the cell's TTFT target and stall
    budget (`adaptive.slo_ttft_ms`, `adaptive.slo_max_gap_ms`), as an operator would."""
    config = tmp / "adaptive.yaml"
    gap = args.slo_max_gap_multiplier * unloaded.tpot_ms
    targets = f"slo_ttft_ms: {SLO_MULTIPLIER * unloaded.ttft_ms:.1f}"
    if gap:
        targets += f", slo_max_gap_ms: {gap:.1f}"
    write_adaptive(config, args.model, targets)
    return (*DEPLOYMENTS[:2], f"adaptive={config}")


def write_adaptive(path: Path, model: str | None, targets: str) -> None:
    """An adaptive deployment's YAML (every core, as `adaptive`), told `targets`; a YAML
    deployment takes its model from the file, not from compare's --model."""
    text = f"adaptive: {{enabled: true, {targets}}}\n"
    path.write_text(text if model is None else f"model: {json.dumps(model)}\n{text}")


def cell_estimate_s(cell: Cell, unloaded: Probe) -> float:
    rate = cell.fraction * unloaded.capacity_rps
    return len(DEPLOYMENTS) * unloaded.estimate_s(
        cell.num_requests, rate, mean_len(cell.output_len)
    )


def plan_cells(args: argparse.Namespace) -> tuple[list[Cell], dict[tuple[int, str], Probe]]:
    """Probe every (input, output) shape, then print each cell's estimated wall time."""
    lengths = [int(x) for x in args.lengths.split(",") if x]
    counts = per_length(args.num_requests, lengths)
    probe_counts = per_length(args.capacity_requests, lengths)
    probes = load_probes(args.probes) if args.probes else {}
    cells = []
    skipped = {tuple(item.split(":")) for item in args.skip.split(",") if item}
    for length in lengths:
        for output_len in [x for x in args.output_lens.split(",") if x]:
            if (str(length), output_len) in skipped:
                continue
            if (length, output_len) not in probes:
                shape = shape_flags(args, length, output_len)
                probes[length, output_len] = probe(
                    shape, probe_counts[length], mean_len(output_len)
                )
            for fraction in [float(x) for x in args.fractions.split(",") if x]:
                cells.append(Cell(length, output_len, fraction, counts[length]))
    rounds = [Cell(**{**asdict(c), "round": r}) for r in range(args.rounds) for c in cells]
    print(format_estimates(rounds, probes), flush=True)
    return rounds, probes


def load_probes(path: str) -> dict[tuple[int, str], Probe]:
    """The probes of an earlier run's --output (an --estimate-only one), by shape."""
    fields = ("ttft_ms", "tpot_ms", "capacity_rps", "launch_s")
    probes = json.loads(Path(path).read_text())["probes"]
    return {(p["input_len"], p["output_len"]): Probe(*(p[f] for f in fields)) for p in probes}


def format_estimates(cells: list[Cell], probes: dict[tuple[int, str], Probe]) -> str:
    lines = ["estimated wall time per cell (3 deployments; from collocated's probe):"]
    total = 0.0
    for cell in cells:
        unloaded = probes[cell.input_len, cell.output_len]
        estimate = cell_estimate_s(cell, unloaded)
        total += estimate
        lines.append(
            f"  round {cell.round} ISL {cell.input_len} OSL {cell.output_len} load "
            f"{cell.fraction:g}: {cell.num_requests} requests at "
            f"{cell.fraction * unloaded.capacity_rps:.3f}/s, ~{estimate / 60:.1f} min "
            f"(capacity {unloaded.capacity_rps:.3f}/s, unloaded TTFT {unloaded.ttft_ms:.0f} ms, "
            f"TPOT {unloaded.tpot_ms:.1f} ms, start {unloaded.launch_s:.0f} s)"
        )
    lines.append(f"  total ~{total / 60:.1f} min")
    return "\n".join(lines)


def _num(value: float | None, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def _error(simulated: float | None, real: float | None) -> str:
    if simulated is None or real is None or math.isnan(simulated) or math.isnan(real) or not real:
        return "-"
    return f"{simulated / real - 1:+.0%}"


def markdown(cells: list[dict]) -> str:
    """The real rows (goodput against collocated's), then the simulator's error per cell."""
    head = (
        "| ISL | OSL | load | deployment | good | goodput req/s | vs collocated "
        "| TTFT p50 ms | TTFT p90 ms | longest freeze ms |"
    )
    lines = [head, "|" + " --- |" * 10]
    for cell in cells:
        base = cell["real"]["collocated"]["goodput"]
        for name, row in cell["real"].items():
            ratio = f"{row['goodput'] / base:.2f}x" if base else "-"
            lines.append(
                f"| {cell['input_len']} | {cell['output_len']} | {cell['fraction']:g} | {name} "
                f"| {row['good']}/{row['num_requests']} | {row['goodput']:.3f} | {ratio} "
                f"| {_num(row['p50_ttft_ms'], '.0f')} | {_num(row['p90_ttft_ms'], '.0f')} "
                f"| {_num(row['max_gap_ms'], '.0f')} |"
            )
    if any("simulated" in cell for cell in cells):
        lines += ["", *simulated_markdown(cells)]
    return "\n".join(lines) + "\n"


def simulated_markdown(cells: list[dict]) -> list[str]:
    lines = [
        "| ISL | OSL | load | deployment | good real vs sim | goodput err | TTFT p50 err "
        "| TTFT p90 err | longest freeze real/sim ms |",
        "|" + " --- |" * 9,
    ]
    for cell in [c for c in cells if "simulated" in c]:
        for name, real in cell["real"].items():
            sim = cell["simulated"][name]
            lines.append(
                f"| {cell['input_len']} | {cell['output_len']} | {cell['fraction']:g} | {name} "
                f"| {real['good']} vs {sim['good']} of {real['num_requests']} "
                f"| {_error(sim['goodput'], real['goodput'])} "
                f"| {_error(sim['p50_ttft_ms'], real['p50_ttft_ms'])} "
                f"| {_error(sim['p90_ttft_ms'], real['p90_ttft_ms'])} "
                f"| {_num(real['max_gap_ms'], '.0f')}/{_num(sim['max_gap_ms'], '.0f')} |"
            )
    return lines


def interference(args: argparse.Namespace) -> dict:
    """The mixed-length cell with a p99 ITL budget and the SLO-told adaptive deployment."""
    model = ["--model", args.model] if args.model else []
    shape = [*model, *workload(INTERFERENCE_INPUT, "lognormal:128:0.3", seed=7)]
    unloaded = probe(shape, INTERFERENCE_CAPACITY_REQUESTS, 128)
    rate = args.interference_fraction * unloaded.capacity_rps
    # SLOs: 5x collocated's unloaded p50 TTFT of prompts at the cell's cap, 5x the TPOT of
    # the cell's own prompts, p99 ITL at most --itl-multiplier x the longest prompts' TPOT.
    # adaptive-slo is told the same targets, as an operator would.
    tpot_ms = SLO_MULTIPLIER * unloaded.tpot_ms
    longest = [*model, *workload(str(INTERFERENCE_MAX_INPUT), "lognormal:128:0.3", seed=7)]
    calibration = compare(
        [*longest, "--num-requests", "1", "--calibration-requests", "3"], ("collocated=collocated",)
    )["collocated"]
    ttft_ms = calibration["slo_ttft_ms"]
    itl_ms = args.itl_multiplier * calibration["slo_tpot_ms"] / SLO_MULTIPLIER
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "adaptive-slo.yaml"
        write_adaptive(config, args.model, f"slo_ttft_ms: {ttft_ms:.1f}, slo_itl_ms: {itl_ms:.1f}")
        rows = compare(
            [
                *shape,
                "--arrival",
                "poisson",
                "--rate",
                f"{rate:.4f}",
                "--num-requests",
                str(args.interference_requests),
                "--slo-ttft-ms",
                f"{ttft_ms:.1f}",
                "--slo-tpot-ms",
                f"{tpot_ms:.1f}",
                "--slo-itl-ms",
                f"{itl_ms:.1f}",
            ],
            (*DEPLOYMENTS, f"adaptive-slo={config}"),
        )
    return {
        "fraction": args.interference_fraction,
        "capacity_rps": unloaded.capacity_rps,
        "rate_rps": rate,
        "slo_ms": {"ttft": ttft_ms, "tpot": tpot_ms, "p99_itl": itl_ms},
        "rows": rows,
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="every deployment's model (default: pdserve's)")
    p.add_argument("--lengths", default="128,512,2048", help="mean input lengths")
    p.add_argument(
        "--input-sigma",
        type=float,
        default=0.3,
        help="lognormal sigma of the input lengths about each; 0: fixed",
    )
    p.add_argument(
        "--output-lens",
        default="lognormal:64:0.5",
        help="comma-separated output lengths (bench --output-len specs)",
    )
    p.add_argument("--skip", default="", help="ISL:OSL shapes left out, e.g. 8192:256")
    p.add_argument("--fractions", default="0.5,0.9", help="rates as fractions of capacity")
    p.add_argument("--num-requests", default="30", help="N, or per length: 512:12,2048:10")
    p.add_argument("--capacity-requests", default="16", help="N, or per length as above")
    p.add_argument(
        "--slo-max-gap-multiplier",
        type=float,
        default=10.0,
        help="stall budget: this x the unloaded p50 TPOT; 0: none",
    )
    p.add_argument(
        "--slo-tpot-multiplier",
        type=float,
        default=0.0,
        help="TPOT target: this x the unloaded p50 TPOT; 0: none",
    )
    p.add_argument("--rounds", type=int, default=1, help="times the whole cell list runs")
    p.add_argument("--probes", metavar="JSON", help="reuse an earlier --output's probes")
    p.add_argument(
        "--estimate-only",
        action="store_true",
        help="probe and print the cells' estimated times, run no cell",
    )
    p.add_argument(
        "--simulate",
        metavar="PROFILE",
        help="also replay each cell on pdserve simulate with this profile",
    )
    p.add_argument(
        "--simulate-cells",
        metavar="JSON",
        help="with --simulate: an earlier --output's cells, simulated only",
    )
    p.add_argument("--interference", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--itl-multiplier",
        type=float,
        default=2.0,
        help="p99 ITL SLO: this x the longest prompts' TPOT",
    )
    p.add_argument("--interference-requests", type=int, default=30)
    p.add_argument(
        "--interference-fraction", type=float, default=0.7, help="the interference cell's load"
    )
    p.add_argument("--output", default="adaptive_grid.json")
    return p.parse_args()


def resimulate(path: str, profile: str | None, output: Path) -> None:
    """`--simulate-cells`: an earlier run's cells simulated again (a profile rescaled on the
    machine the grid ran on, a simulator change) against their real rows."""
    if not profile:
        raise SystemExit("--simulate-cells needs --simulate PROFILE")
    results = json.loads(Path(path).read_text())
    for cell in results["cells"]:
        cell["simulated"] = simulate_cell(cell["flags"], profile)
    output.write_text(json.dumps(results, indent=1))
    output.with_suffix(".md").write_text(markdown(results["cells"]))
    print(markdown(results["cells"]))


def main() -> None:
    args = parse_args()
    output = Path(args.output)
    if args.simulate_cells:
        return resimulate(args.simulate_cells, args.simulate, output)
    results: dict = {"cells": [], "interference": None}
    cells, probes = plan_cells(args)
    results["probes"] = [
        {"input_len": n, "output_len": out, **asdict(p)} for (n, out), p in probes.items()
    ]
    output.write_text(json.dumps(results, indent=1))
    if args.estimate_only:
        return
    for cell in cells:
        results["cells"].append(run_cell(args, cell, probes[cell.input_len, cell.output_len]))
        output.write_text(json.dumps(results, indent=1))
        output.with_suffix(".md").write_text(markdown(results["cells"]))
    if args.interference:
        results["interference"] = interference(args)
    output.write_text(json.dumps(results, indent=1))
    if results["cells"]:
        print(markdown(results["cells"]))


if __name__ == "__main__":
    main()
